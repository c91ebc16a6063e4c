// Graph breaks in the root frame: the plan (can we split here, what is live), the transformed code that
// runs the break instruction eagerly, and the resume functions that continue after it.
#include "trace/graph_break.h"

#include <algorithm>
#include <map>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "common/error.h"

namespace kiln::trace {

using bytecode::Instruction;

namespace {

constexpr bool kCallableAfterNull = PY_VERSION_HEX < 0x030D0000;  // 3.11/3.12: [NULL, callable, args]
constexpr bool kHasPrecall = PY_VERSION_HEX < 0x030C0000;

// Stack slots a break instruction consumes, by opcode name: what runs in plain Python at a break. What
// it pushes follows from the interpreter's stack effect. Instructions missing here do not break (the
// frame runs eagerly); those that may push a NULL (method loads) cannot be rebuilt and stay out.
int consumed_by(const std::string& name, int arg) {
  static const std::unordered_map<std::string, int (*)(int)> table = {
      {"CALL", [](int a) { return a + 2; }},
      {"CALL_KW", [](int a) { return a + 3; }},
      {"CALL_FUNCTION_EX", [](int a) { return 3 + (a & 1); }},
      {"POP_JUMP_IF_TRUE", [](int) { return 1; }},
      {"POP_JUMP_IF_FALSE", [](int) { return 1; }},
      {"POP_JUMP_IF_NONE", [](int) { return 1; }},
      {"POP_JUMP_IF_NOT_NONE", [](int) { return 1; }},
      {"POP_JUMP_FORWARD_IF_TRUE", [](int) { return 1; }},
      {"POP_JUMP_FORWARD_IF_FALSE", [](int) { return 1; }},
      {"POP_JUMP_FORWARD_IF_NONE", [](int) { return 1; }},
      {"POP_JUMP_FORWARD_IF_NOT_NONE", [](int) { return 1; }},
      {"JUMP_IF_TRUE_OR_POP", [](int) { return 1; }},
      {"JUMP_IF_FALSE_OR_POP", [](int) { return 1; }},
      {"TO_BOOL", [](int) { return 1; }},
      {"UNARY_NOT", [](int) { return 1; }},
      {"UNARY_NEGATIVE", [](int) { return 1; }},
      {"UNARY_INVERT", [](int) { return 1; }},
      {"BINARY_OP", [](int) { return 2; }},
      {"BINARY_SUBSCR", [](int) { return 2; }},
      {"COMPARE_OP", [](int) { return 2; }},
      {"CONTAINS_OP", [](int) { return 2; }},
      {"BEFORE_WITH", [](int) { return 1; }},
      {"STORE_ATTR", [](int) { return 2; }},
      {"DELETE_ATTR", [](int) { return 1; }},
      {"STORE_GLOBAL", [](int) { return 1; }},
      {"STORE_SUBSCR", [](int) { return 3; }},
      {"DELETE_SUBSCR", [](int) { return 2; }},
      {"RAISE_VARARGS", [](int a) { return a; }},
      {"IMPORT_NAME", [](int) { return 2; }},
      {"GET_ITER", [](int) { return 1; }},
      {"BUILD_SET", [](int a) { return a; }},
      {"UNPACK_SEQUENCE", [](int) { return 1; }},
      {"FORMAT_VALUE", [](int a) { return (a & 4) ? 2 : 1; }},
      {"BUILD_STRING", [](int a) { return a; }},
  };
  // 3.11's LOAD_ATTR never pushes a NULL; 3.12+ does with bit 0 (method form).
  if (name == "LOAD_ATTR" && (PY_VERSION_HEX < 0x030C0000 || !(arg & 1))) return 1;
  auto it = table.find(name);
  return it == table.end() ? -1 : it->second(arg);
}

// Why a live value cannot be rebuilt after the break ("" when it can). `seen` stops at containers already
// visited (the output keeps a container reachable twice as one object, see OutputSpec::kRepeat).
std::string unrebuildable(const VarPtr& v, std::unordered_set<const Var*>& seen) {
  switch (v->kind) {
    case VarKind::kTensor:
    case VarKind::kModule: return "";
    case VarKind::kConst: {
      // A constant made from a fake tensor (a bound method of one) would call into the fake at run time.
      PyObject* self = PyObject_GetAttrString(v->value, "__self__");
      if (!self) PyErr_Clear();
      bool fake_bound = self && PyObject_HasAttrString(self, "is_meta") && PyObject_HasAttrString(self, "grad_fn");
      Py_XDECREF(self);
      return fake_bound ? "a method of a traced tensor" : "";
    }
    case VarKind::kSlice: return is_constant(v) ? "" : "a slice of traced values";
    case VarKind::kMethod: return unrebuildable(v->items[0], seen);
    case VarKind::kTuple:
    case VarKind::kList:
    case VarKind::kDict:
    case VarKind::kObject:  // a record built in the trace: constructed again from its rebuilt arguments
      if (v->source) return "";  // re-read from the frame
      if (!seen.insert(v.get()).second) return "";  // rebuilt once (memo slot), visited once
      for (const VarPtr& item : v->items) {
        std::string why = unrebuildable(item, seen);
        if (!why.empty()) return why;
      }
      return "";
    case VarKind::kIterator: return "an iterator (the break is inside a for loop)";
    case VarKind::kNull: return "a NULL inside a value";
  }
  return "a " + v->describe();
}

// Instructions reached from the entry by falling through and jumping, without exception edges.
std::vector<bool> reachable_without_exceptions(const bytecode::CodeInstructions& ci) {
  const auto& ops = bytecode::opcodes();
  std::vector<bool> seen(ci.instructions.size(), false);
  std::vector<int> work = {0};
  while (!work.empty()) {
    int i = work.back();
    work.pop_back();
    if (i < 0 || i >= (int)ci.instructions.size() || seen[i]) continue;
    seen[i] = true;
    const Instruction& ins = ci.instructions[i];
    if (ops.is_jump(ins.opcode) && ins.target >= 0) work.push_back(ins.target);
    if (!ops.is_terminator(ins.opcode)) work.push_back(i + 1);
  }
  return seen;
}

const bytecode::ExceptionEntry* covering(const bytecode::CodeInstructions& ci, int index) {
  for (const bytecode::ExceptionEntry& e : ci.exception_table)
    if (e.start <= index && index < e.end) return &e;
  return nullptr;
}

bool is_grad_mode_exit(const VarPtr& v) {
  if (!v || !v->is(VarKind::kMethod) || !v->items[0]->is(VarKind::kConst) || !v->items[0]->value) return false;
  static PyObject* check = [] {
    PyObject* m = PyImport_ImportModule("kiln._tracing");
    PyObject* f = m ? PyObject_GetAttrString(m, "is_grad_mode_context") : nullptr;
    Py_XDECREF(m);
    return f;
  }();
  if (!check) {
    PyErr_Clear();
    return false;
  }
  PyObject* r = PyObject_CallOneArg(check, v->items[0]->value);
  if (!r) PyErr_Clear();
  bool yes = r == Py_True;
  Py_XDECREF(r);
  return yes;
}

// Follows the path an exception raised at the break instruction takes through the exception table. It may
// only leave through grad-mode `with` blocks (their __exit__ restores the mode and re-raises): anything
// else (a try block, another context manager) is refused. Returns the mode eager leaves the frame in after
// such an exception (the mode before the outermost block), or -1 when the break is in no block.
int enclosing_grad_mode_blocks(const bytecode::CodeInstructions& ci, const BreakState& state, std::string* why_not) {
  const auto& ops = bytecode::opcodes();
  auto name_at = [&](int i) -> std::string {
    return i >= 0 && i < (int)ci.instructions.size() ? ops.name(ci.instructions[i].opcode) : "";
  };
  int mode = -1;
  int at = state.pc;
  for (int hops = 0; hops < 64; ++hops) {
    const bytecode::ExceptionEntry* entry = covering(ci, at);
    if (!entry) return mode;
    // A with statement's handler: PUSH_EXC_INFO, WITH_EXCEPT_START, with __exit__ at stack[depth - 1].
    bool with_handler = name_at(entry->target) == "PUSH_EXC_INFO" && name_at(entry->target + 1) == "WITH_EXCEPT_START";
    if (!with_handler) {
      *why_not = "the construct is inside a try block";
      return -1;
    }
    if (entry->depth < 1 || entry->depth > (int)state.stack.size() || !is_grad_mode_exit(state.stack[entry->depth - 1])) {
      *why_not = "the construct is inside a with block whose context manager is not a grad-mode one "
                 "(user context managers are not resumed: the frame runs eagerly)";
      return -1;
    }
    PyObject* prev = PyObject_GetAttrString(state.stack[entry->depth - 1]->items[0]->value, "prev");
    if (!prev || !PyBool_Check(prev)) {
      PyErr_Clear();
      Py_XDECREF(prev);
      *why_not = "the grad-mode block's saved mode is unknown";
      return -1;
    }
    mode = prev == Py_True ? 1 : 0;  // the outermost block's, once the walk ends
    Py_DECREF(prev);
    // The handler re-raises from inside its cleanup entry; the exception goes on from that entry's target.
    const bytecode::ExceptionEntry* cleanup = covering(ci, entry->target);
    if (!cleanup) {
      *why_not = "a with statement's handler without a cleanup entry";
      return -1;
    }
    at = cleanup->target;
  }
  *why_not = "with blocks nested too deeply";
  return -1;
}

}  // namespace

BreakPlan plan_break(PyCodeObject* code, const bytecode::CodeInstructions& ci, const BreakState& state) {
  const auto& ops = bytecode::opcodes();
  BreakPlan plan;
  plan.pc = state.pc;
  const Instruction& ins = ci.instructions.at(state.pc);
  plan.instruction = ops.name(ins.opcode);
  if (code->co_ncellvars > 0) {
    plan.why_not = "the frame has cells (variables captured by a nested function)";
    return plan;
  }
  // Zero-argument super() reads the frame's first local as its object; a resume function's first argument is
  // whatever was live, so super() there would raise (or bind the wrong object).
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(code->co_localsplusnames); ++i) {
    PyObject* name = PyTuple_GET_ITEM(code->co_localsplusnames, i);
    if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "__class__") == 0) {
      plan.why_not = "the frame uses zero-argument super() (its __class__ cell)";
      return plan;
    }
  }
  if (plan.instruction == "BEFORE_WITH") {
    // Only grad-mode blocks are traced (grad_mode.cpp); other context managers keep the frame eager.
    plan.why_not = "a with statement on a context manager other than torch.no_grad/enable_grad/set_grad_enabled "
                   "(user context managers are not resumed: the frame runs eagerly)";
    return plan;
  }
  plan.restore_grad_mode = enclosing_grad_mode_blocks(ci, state, &plan.why_not);
  if (!plan.why_not.empty()) return plan;
  // Exception handlers are not part of a loop even when they jump backward (3.12 puts a with statement's
  // handler after the function body and jumps back from it).
  std::vector<bool> normal_flow = reachable_without_exceptions(ci);
  for (size_t j = 0; j < ci.instructions.size(); ++j) {
    const Instruction& jump = ci.instructions[j];
    if (!normal_flow[j]) continue;
    if (ops.is_jump(jump.opcode) && jump.target >= 0 && jump.target <= state.pc && (int)j >= state.pc) {
      plan.why_not = "the construct is inside a loop";
      return plan;
    }
  }
  plan.consumed = consumed_by(plan.instruction, ins.arg);
  if (plan.consumed < 0) {
    plan.why_not = "no graph break at " + plan.instruction + " yet";
    return plan;
  }
  int depth = (int)state.stack.size();
  KILN_ASSERT(plan.consumed <= depth) << plan.instruction << " consumes more than the symbolic stack holds";
  // Calls push their result (3.11's CALL alone reports only its share of PRECALL+CALL's effect).
  bool call = plan.instruction.rfind("CALL", 0) == 0;
  if (!ops.is_terminator(ins.opcode))
    plan.successors.push_back(
        {state.pc + 1, call ? 1 : plan.consumed + ops.stack_effect(ins.opcode, ins.arg, false)});
  if (ops.is_jump(ins.opcode)) {
    KILN_ASSERT(ins.target > state.pc) << "a break at a backward jump outside a loop";
    plan.successors.push_back({ins.target, plan.consumed + ops.stack_effect(ins.opcode, ins.arg, true)});
  }
  std::unordered_set<const Var*> seen;
  for (const VarPtr& v : state.stack) {
    plan.stack_null.push_back(v->is(VarKind::kNull));
    if (v->is(VarKind::kNull)) continue;
    std::string why = unrebuildable(v, seen);
    if (!why.empty()) {
      plan.why_not = "the stack holds " + why;
      return plan;
    }
  }
  // Free variables (the last slots) are not locals: the resume function gets the same closure cells.
  size_t first_free = state.locals.size() - code->co_nfreevars;
  for (size_t i = 0; i < first_free; ++i) {
    if (!state.locals[i]) continue;
    std::string why = unrebuildable(state.locals[i], seen);
    if (!why.empty()) {
      plan.why_not = "a local holds " + why;
      return plan;
    }
    plan.live_locals.push_back((int)i);
  }
  if (state.kwnames) {
    for (int k = state.pc - 1; k >= 0 && k >= state.pc - 2; --k)
      if (ci.instructions[k].opcode == ops.op("KW_NAMES")) plan.kwnames_const = ci.instructions[k].arg;
    if (plan.kwnames_const < 0) plan.why_not = "keyword names of the call not found";
  }
  return plan;
}

VarPtr break_values(const BreakPlan& plan, const BreakState& state) {
  std::vector<VarPtr> items;
  for (int i : plan.live_locals) items.push_back(state.locals[i]);
  for (auto it = state.stack.rbegin(); it != state.stack.rend(); ++it)
    if (!(*it)->is(VarKind::kNull)) items.push_back(*it);
  return make_sequence(VarKind::kTuple, std::move(items));
}

namespace {

// Appends instructions, all at one source position.
struct Emitter {
  bytecode::CodeInstructions& out;
  bytecode::Positions pos;
  int emit(const char* name, int arg = 0) {
    int op = bytecode::opcodes().op(name);
    KILN_ASSERT(op >= 0) << "opcode " << name << " missing in this Python";
    Instruction ins;
    ins.opcode = op;
    ins.arg = arg;
    ins.pos = pos;
    out.instructions.push_back(ins);
    return (int)out.instructions.size() - 1;
  }
  /// Moves the top of the stack down to `depth` (1 = top), keeping the order of the others.
  void sink_top(int depth) {
    for (int d = depth; d >= 2; --d) emit("SWAP", d);
  }
  void call(int nargs) {
    if (kHasPrecall) emit("PRECALL", nargs);
    emit("CALL", nargs);
  }
  /// Puts `callable` (a constant index) and its NULL under the top `nitems` stack values.
  void callable_under(int callable_const, int nitems) {
    for (int step = 0; step < 2; ++step) {
      bool push_null = (step == 0) == kCallableAfterNull;
      if (push_null)
        emit("PUSH_NULL");
      else
        emit("LOAD_CONST", callable_const);
      sink_top(nitems + 1);
    }
  }
};

// Copies the original prologue (COPY_FREE_VARS, MAKE_CELL..., RESUME) and returns the RESUME index.
int prologue_end(const bytecode::CodeInstructions& ci) {
  const auto& ops = bytecode::opcodes();
  for (size_t i = 0; i < ci.instructions.size(); ++i)
    if (ci.instructions[i].opcode == ops.op("RESUME")) return (int)i;
  KILN_ASSERT(false) << "no RESUME in the prologue";
  return -1;
}

PyObject* tuple_plus(PyObject* tuple, const std::vector<PyObject*>& extra) {
  Py_ssize_t n = PyTuple_GET_SIZE(tuple);
  PyObject* out = PyTuple_New(n + extra.size());
  for (Py_ssize_t i = 0; i < n; ++i) {
    Py_INCREF(PyTuple_GET_ITEM(tuple, i));
    PyTuple_SET_ITEM(out, i, PyTuple_GET_ITEM(tuple, i));
  }
  for (size_t i = 0; i < extra.size(); ++i) {
    Py_INCREF(extra[i]);
    PyTuple_SET_ITEM(out, n + i, extra[i]);
  }
  return out;
}

}  // namespace

PyObject* make_break_code(PyCodeObject* original, const bytecode::CodeInstructions& ci, const BreakPlan& plan,
                          PyObject* program, const std::vector<PyObject*>& resume_functions) {
  const auto& ops = bytecode::opcodes();
  KILN_ASSERT(resume_functions.size() == plan.successors.size()) << "one resume function per successor";
  bytecode::CodeInstructions out;
  out.firstlineno = original->co_firstlineno;
  int resume_at = prologue_end(ci);
  for (int i = 0; i <= resume_at; ++i) {
    out.instructions.push_back(ci.instructions[i]);
    out.instructions.back().target = -1;
  }
  const Instruction& broken = ci.instructions[plan.pc];
  Emitter e{out, broken.pos};
  int program_const = (int)PyTuple_GET_SIZE(original->co_consts);
  std::optional<bytecode::ExceptionEntry> grad_restore_entry;

  // values = program(arguments..., free variables...)
  int nargs = original->co_argcount + original->co_kwonlyargcount + ((original->co_flags & CO_VARARGS) ? 1 : 0) +
              ((original->co_flags & CO_VARKEYWORDS) ? 1 : 0);
  if (kCallableAfterNull) e.emit("PUSH_NULL");
  e.emit("LOAD_CONST", program_const);
  if (!kCallableAfterNull) e.emit("PUSH_NULL");
  int nlocalsplus = (int)PyTuple_GET_SIZE(original->co_localsplusnames);
  int nfree = original->co_nfreevars;
  for (int i = 0; i < nargs; ++i) e.emit("LOAD_FAST", i);
  for (int j = 0; j < nfree; ++j) e.emit("LOAD_DEREF", nlocalsplus - nfree + j);
  e.call(nargs + nfree);
  // Arguments the original had already unbound (a resume function's stack arguments, a `del`) must not
  // stay bound here: eager would have let them go, and a frame kept by a traceback would keep them.
  for (int i = 0; i < nargs; ++i)
    if (std::find(plan.live_locals.begin(), plan.live_locals.end(), i) == plan.live_locals.end())
      e.emit("DELETE_FAST", i);

  // Unpack: locals on top (stored first), then the non-NULL stack slots, bottom one deepest.
  int below = (int)plan.stack_null.size() - plan.consumed;
  int nonnull_total = 0, nonnull_below = 0;
  for (int i = 0; i < (int)plan.stack_null.size(); ++i)
    if (!plan.stack_null[i]) {
      ++nonnull_total;
      if (i < below) ++nonnull_below;
    }
  int nvalues = (int)plan.live_locals.size() + nonnull_total;
  if (nvalues == 0)
    e.emit("POP_TOP");
  else
    e.emit("UNPACK_SEQUENCE", nvalues);
  for (int local : plan.live_locals) e.emit("STORE_FAST", local);
  // The consumed slots' NULLs go back in place (the NULLs below them are re-pushed by the resume code).
  int height = nonnull_total;
  for (int k = 0; k < plan.consumed; ++k) {
    if (!plan.stack_null[below + k]) continue;
    int position = nonnull_below + k;  // final index from the bottom of the rebuilt part
    e.emit("PUSH_NULL");
    ++height;
    e.sink_top(height - position);
  }

  // The original instruction, as CPython runs it.
  if (plan.kwnames_const >= 0) e.emit("KW_NAMES", plan.kwnames_const);
  if (kHasPrecall && ops.name(broken.opcode) == std::string("CALL")) e.emit("PRECALL", broken.arg);
  Instruction copy = broken;
  copy.offset = -1;
  copy.target = -1;
  out.instructions.push_back(copy);
  int jump_index = (int)out.instructions.size() - 1;
  const int extra_consts = 1 + (int)resume_functions.size();  // program, resume functions, then these
  if (plan.restore_grad_mode >= 0) {
    // The break runs inside grad-mode blocks that this code no longer has: an exception from it leaves
    // the frame with the mode eager's __exit__ calls would have restored (graph_break.h).
    bytecode::ExceptionEntry restore;
    restore.start = jump_index;
    restore.end = jump_index + 1;
    restore.depth = 0;
    restore.lasti = false;
    grad_restore_entry = restore;
  }

  // One tail per successor: return resume(stack..., locals...).
  for (size_t s = 0; s < plan.successors.size(); ++s) {
    if (s == 1) out.instructions[jump_index].target = (int)out.instructions.size();
    int nitems = nonnull_below + plan.successors[s].pushed;
    if (nfree == 0) {
      e.callable_under(program_const + 1 + (int)s, nitems);
    } else {
      // A closure needs the frame's own cells: the function is made here, from the resume code.
      if (!kCallableAfterNull) KILN_UNSUPPORTED() << "graph breaks in closures on this Python";
      e.emit("PUSH_NULL");
      e.sink_top(nitems + 1);
      for (int j = 0; j < nfree; ++j) e.emit("LOAD_CLOSURE", nlocalsplus - nfree + j);
      e.emit("BUILD_TUPLE", nfree);
      e.emit("LOAD_CONST", program_const + 1 + (int)s);
      e.emit("MAKE_FUNCTION", 0x08);
      e.sink_top(nitems + 1);
    }
    for (int local : plan.live_locals) e.emit("LOAD_FAST", local);
    e.call(nitems + (int)plan.live_locals.size());
    e.emit("RETURN_VALUE");
  }
  if (grad_restore_entry) {
    // handler: [exc] -> torch._C._set_grad_enabled(mode) -> re-raise exc
    grad_restore_entry->target = (int)out.instructions.size();
    out.exception_table.push_back(*grad_restore_entry);
    e.callable_under(program_const + extra_consts, 0);
    e.emit("LOAD_CONST", program_const + extra_consts + 1);
    e.call(1);
    e.emit("POP_TOP");
    e.emit("RERAISE", 0);
  }

  std::vector<PyObject*> extra = {program};
  extra.insert(extra.end(), resume_functions.begin(), resume_functions.end());
  PyObject* setter = nullptr;
  if (grad_restore_entry) {
    PyObject* tracing = PyImport_ImportModule("kiln._tracing");
    setter = tracing ? PyObject_GetAttrString(tracing, "set_grad_enabled") : nullptr;
    Py_XDECREF(tracing);
    if (!setter) {
      PyErr_Clear();
      KILN_UNSUPPORTED() << "kiln._tracing.set_grad_enabled is missing";
    }
    extra.push_back(setter);
    extra.push_back(plan.restore_grad_mode ? Py_True : Py_False);
  }
  struct ReleaseSetter {
    PyObject* setter;
    ~ReleaseSetter() { Py_XDECREF(setter); }
  } release_setter{setter};
  PyObject* consts = tuple_plus(original->co_consts, extra);
  PyObject* kwargs = Py_BuildValue("{s:N}", "co_consts", consts);
  PyObject* result = nullptr;
  try {
    result = bytecode::make_code(original, out, kwargs);
  } catch (...) {
    Py_DECREF(kwargs);
    throw;
  }
  Py_DECREF(kwargs);
  return result;
}

PyObject* resume_code(PyCodeObject* original, const bytecode::CodeInstructions& ci, const BreakPlan& plan,
                      const BreakSuccessor& successor) {
  const auto& ops = bytecode::opcodes();
  // The layout: which slots of the resume stack are NULL, and which locals arrive as arguments.
  int below = (int)plan.stack_null.size() - plan.consumed;
  std::vector<bool> stack_null(plan.stack_null.begin(), plan.stack_null.begin() + below);
  stack_null.insert(stack_null.end(), successor.pushed, false);
  std::string key = std::to_string((uintptr_t)original) + "@" + std::to_string(successor.target) + ":";
  for (bool null : stack_null) key += null ? 'N' : 'v';
  for (int local : plan.live_locals) key += "," + std::to_string(local);
  struct Cached {
    PyObject* original;
    PyObject* code;
  };
  static std::map<std::string, Cached> cache;  // entries live for the process, like the code they copy
  auto hit = cache.find(key);
  if (hit != cache.end()) return hit->second.code;

  // Arguments: the non-NULL stack slots, then the live locals; the other locals follow as plain locals.
  PyObject* varnames = PyCode_GetVarnames(original);
  KILN_ASSERT(varnames) << "co_varnames";
  int nvarnames = (int)PyTuple_GET_SIZE(varnames);
  std::vector<PyObject*> names;
  std::vector<int> new_index(nvarnames, -1);
  std::vector<int> stack_args;  // argument index for each resume stack slot (-1 = NULL)
  for (bool null : stack_null) {
    if (null) {
      stack_args.push_back(-1);
      continue;
    }
    stack_args.push_back((int)names.size());
    names.push_back(PyUnicode_FromFormat("___stack%d", (int)names.size()));
  }
  for (int local : plan.live_locals) {
    new_index[local] = (int)names.size();
    names.push_back(Py_NewRef(PyTuple_GET_ITEM(varnames, local)));
  }
  int nargs = (int)names.size();
  for (int i = 0; i < nvarnames; ++i)
    if (new_index[i] < 0) {
      new_index[i] = (int)names.size();
      names.push_back(Py_NewRef(PyTuple_GET_ITEM(varnames, i)));
    }
  Py_DECREF(varnames);
  // Free variables follow the locals in both layouts (no cells: plan_break refuses them).
  int nfree = original->co_nfreevars;
  int extra = (int)names.size() - nvarnames;
  PyObject* new_varnames = PyTuple_New(names.size());
  for (size_t i = 0; i < names.size(); ++i) PyTuple_SET_ITEM(new_varnames, i, names[i]);

  bytecode::CodeInstructions out;
  out.firstlineno = original->co_firstlineno;
  const Instruction& target = ci.instructions.at(successor.target);
  Emitter e{out, target.pos};
  if (nfree > 0) e.emit("COPY_FREE_VARS", nfree);
  e.emit("RESUME", 0);
  for (int arg : stack_args) {
    if (arg < 0)
      e.emit("PUSH_NULL");
    else
      e.emit("LOAD_FAST", arg);
  }
  // Eager holds these values only on the stack: a local copy would outlive them (an exception raised
  // from the stack would reach itself through its traceback's frame, a cycle that eager never makes).
  for (int arg : stack_args)
    if (arg >= 0) e.emit("DELETE_FAST", arg);
  int jump = e.emit("JUMP_FORWARD", 0);
  // A copy of the original body after its prologue, shifted by `shift` instructions.
  int first = prologue_end(ci) + 1;
  int shift = (int)out.instructions.size() - first;
  out.instructions[jump].target = successor.target + shift;
  auto remap = [&](int index) {
    KILN_ASSERT(index >= 0 && index < nvarnames) << "local index " << index << " out of range";
    return new_index[index];
  };
  const int load_pair[] = {ops.op("LOAD_FAST_LOAD_FAST"), ops.op("STORE_FAST_LOAD_FAST"),
                           ops.op("STORE_FAST_STORE_FAST")};
  for (size_t i = first; i < ci.instructions.size(); ++i) {
    Instruction ins = ci.instructions[i];
    ins.offset = -1;
    if (ins.target >= 0) ins.target += shift;
    bool pair = false;
    for (int op : load_pair) pair = pair || (op >= 0 && ins.opcode == op);
    if (pair) {
      int hi = remap(ins.arg >> 4), lo = remap(ins.arg & 15);
      if (hi > 15 || lo > 15) KILN_UNSUPPORTED() << "a resume function whose locals do not fit a paired load";
      ins.arg = (hi << 4) | lo;
    } else if (ops.has_local(ins.opcode)) {
      ins.arg = remap(ins.arg);
    } else if (ops.has_free(ins.opcode)) {
      KILN_ASSERT(ins.arg >= nvarnames) << "a free-variable instruction on a plain local";
      ins.arg += extra;  // free variables moved up by the added stack arguments
    }
    out.instructions.push_back(ins);
  }
  for (const bytecode::ExceptionEntry& entry : ci.exception_table) {
    if (entry.end <= first) continue;
    bytecode::ExceptionEntry moved = entry;
    moved.start = std::max(entry.start, first) + shift;
    moved.end = entry.end + shift;
    moved.target = entry.target + shift;
    out.exception_table.push_back(moved);
  }

  std::string qualname = std::string(PyUnicode_AsUTF8(original->co_qualname)) + ".<resume at line " +
                         std::to_string(target.pos.line) + ">";
  int flags = original->co_flags & ~(CO_VARARGS | CO_VARKEYWORDS);
  PyObject* kwargs = Py_BuildValue("{s:N,s:i,s:i,s:i,s:i,s:i,s:s}", "co_varnames", new_varnames, "co_argcount", nargs,
                                   "co_posonlyargcount", 0, "co_kwonlyargcount", 0, "co_nlocals",
                                   (int)names.size(), "co_flags", flags, "co_qualname", qualname.c_str());
  PyObject* code = nullptr;
  try {
    code = bytecode::make_code(original, out, kwargs);
  } catch (...) {
    Py_DECREF(kwargs);
    throw;
  }
  Py_DECREF(kwargs);
  cache[key] = Cached{Py_NewRef((PyObject*)original), code};
  return code;
}

}  // namespace kiln::trace
