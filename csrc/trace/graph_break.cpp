// Graph breaks in the root frame: the plan (can we split here, what is live) and the live values. The code
// that runs the break instruction eagerly and the resume functions that continue after it: break_code.cpp.
#include "trace/graph_break.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "common/error.h"
#include "trace/code_layout.h"

namespace kiln::trace {

using bytecode::Instruction;

namespace {

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
      {"POP_JUMP_BACKWARD_IF_TRUE", [](int) { return 1; }},  // 3.11's loop conditions (breaks inside a loop)
      {"POP_JUMP_BACKWARD_IF_FALSE", [](int) { return 1; }},
      {"POP_JUMP_BACKWARD_IF_NONE", [](int) { return 1; }},
      {"POP_JUMP_BACKWARD_IF_NOT_NONE", [](int) { return 1; }},
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
      {"STORE_SLICE", [](int) { return 4; }},
      {"BINARY_SLICE", [](int) { return 3; }},
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

}  // namespace

std::string unrebuildable(const VarPtr& v, std::unordered_set<const Var*>& seen) {
  if (v->caught) return "an exception raised and caught in the traced code (eager's traceback cannot be rebuilt)";
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
    case VarKind::kSet:
    case VarKind::kObject:  // a record built in the trace: constructed again from its rebuilt arguments
    case VarKind::kUserObject:  // made from its class and its attribute table
      // rebuilt, it would be a list
      if (v->is(VarKind::kList) && v->real_type) return is_dict_view(v) ? "a dict view" : "a slice of a ModuleList";
      if (v->source) return "";  // re-read from the frame
      if (!seen.insert(v.get()).second) return "";  // rebuilt once (memo slot), visited once
      for (const VarPtr& item : v->items) {
        std::string why = unrebuildable(item, seen);
        if (!why.empty()) return why;
      }
      return "";
    case VarKind::kIterator: return "an iterator outside a for loop's own stack slot";
    case VarKind::kNull: return "a NULL inside a value";
    case VarKind::kSuper:  // trace-only helpers (super(), closure cells, functions and partials made in the
    case VarKind::kCell:   // trace, ContextVar tokens): not rebuilt in Python; a break with one live is refused
    case VarKind::kFunction:
    case VarKind::kPartial:
    case VarKind::kToken:
    case VarKind::kGenerator: break;
  }
  return "a " + v->describe();
}

namespace {

// Items a loop iterator may have left at a break: each iteration is one more resume call (and cache entry).
constexpr size_t kMaxIterationsLeft = 64;

// Why a for loop's iterator on the stack cannot travel to the resume function ("" when it can): it must be
// the loop's own (held nowhere else, or the rebuilt copy and the other holder would part ways), with few
// enough items left, each rebuildable.
std::string loop_iterator_unrebuildable(const VarPtr& it, const BreakState& state, std::unordered_set<const Var*>& seen) {
  int holders = 0;
  for (const VarPtr& v : state.stack) holders += v == it;
  for (const VarPtr& v : state.locals) holders += v == it;
  if (holders != 1) return "an iterator also held elsewhere (a local or another stack slot)";
  size_t left = it->items.size() - it->position;
  if (left > kMaxIterationsLeft)
    return "a loop iterator with " + std::to_string(left) + " items left (more than " +
           std::to_string(kMaxIterationsLeft) + " resumed iterations)";
  for (size_t i = it->position; i < it->items.size(); ++i) {
    std::string why = unrebuildable(it->items[i], seen);
    if (!why.empty()) return why + " (an item of a loop's iterator)";
  }
  return "";
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

// kiln._tracing.<name>, looked up once (a new reference kept for the process), or nullptr.
PyObject* tracing_function(const char* name) {
  PyObject* m = PyImport_ImportModule("kiln._tracing");
  PyObject* f = m ? PyObject_GetAttrString(m, name) : nullptr;
  Py_XDECREF(m);
  if (!f) PyErr_Clear();
  return f;
}

// True when `v` is the __exit__ of a context manager that `predicate` (a kiln._tracing function) accepts.
bool is_exit_of(const VarPtr& v, PyObject* predicate) {
  if (!predicate || !v || !v->is(VarKind::kMethod) || !v->items[0]->is(VarKind::kConst) || !v->items[0]->value)
    return false;
  PyObject* r = PyObject_CallOneArg(predicate, v->items[0]->value);
  if (!r) PyErr_Clear();
  bool yes = r == Py_True;
  Py_XDECREF(r);
  return yes;
}

bool is_grad_mode_exit(const VarPtr& v) {
  static PyObject* predicate = tracing_function("is_grad_mode_context");
  return is_exit_of(v, predicate);
}

}  // namespace

bool is_traced_autocast_exit(const VarPtr& v) {
  static PyObject* predicate = tracing_function("is_autocast_context");
  return is_exit_of(v, predicate) && !v->items[0]->source;
}

namespace {

// Follows the path an exception raised at the break instruction takes through the exception table. When it
// only leaves through grad-mode `with` blocks (their __exit__ restores the mode and re-raises), returns the
// mode eager leaves the frame in after such an exception (the mode before the outermost block), or -1 when
// the break is in no block. Anything else (a try block, another context manager) sets `why_not`: the break
// code then sends the exception to the original handler instead (plan_break).
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
      *why_not = "the construct is inside a with block whose context manager is not a grad-mode one";
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

// A function with a closure made in the trace (`v`, held by local `slot`): the break code makes it again from
// its code and constant defaults around the frame's own cells, which must be every cell it closes over.
// Returns why not ("" when it can).
std::string plan_closure(const VarPtr& v, const BreakState& state, const char* kinds, int slot, bool in_cell,
                         BreakPlan& plan) {
  BreakPlan::Closure closure;
  closure.slot = slot;
  closure.in_cell = in_cell;
  closure.function = v->value;
  for (size_t k = 0; k < plan.closures.size(); ++k)
    if (plan.closures[k].function == v->value) closure.same_as = (int)k;
  for (const VarPtr& c : v->items) {
    int found = -1;
    for (size_t j = 0; j < state.locals.size() && found < 0; ++j)
      if (state.locals[j] == c && (kinds[j] & (kFastCell | kFastFree))) found = (int)j;
    if (found < 0) return "a function made in traced code that closes over variables of another function";
    closure.cells.push_back(found);
  }
  plan.closures.push_back(std::move(closure));
  return "";
}

}  // namespace

BreakPlan plan_break(PyCodeObject* code, const bytecode::CodeInstructions& ci, const BreakState& state) {
  const auto& ops = bytecode::opcodes();
  BreakPlan plan;
  plan.pc = state.pc;
  const Instruction& ins = ci.instructions.at(state.pc);
  plan.instruction = ops.name(ins.opcode);
  if (code->co_ncellvars > 0 && PY_VERSION_HEX >= 0x030D0000) {
    plan.why_not = "the frame has cells (variables captured by a nested function) on Python 3.13";
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
  // The exception an except block handles is CPython's current exception (sys.exc_info(), a bare `raise`,
  // logger.exception); the code after a break runs in a resume function where none is, so the frame runs eagerly.
  if (state.handling_exception) {
    plan.why_not = "the construct is inside an except block (the exception it handles would not be current after a "
                   "graph break)";
    return plan;
  }
  // A torch.autocast block entered at trace time was never entered at run time: the compiled frame enters it
  // after its graph (break_values, output_spec).
  // Inside grad-mode blocks only: the break code restores the mode on an exception. Inside any other block:
  // the exception goes to the original handler, in a copy of the body the break code carries.
  std::string not_grad_mode_only;
  plan.restore_grad_mode = enclosing_grad_mode_blocks(ci, state, &not_grad_mode_only);
  if (!not_grad_mode_only.empty()) {
    plan.restore_grad_mode = -1;
    const bytecode::ExceptionEntry* entry = covering(ci, state.pc);
    KILN_ASSERT(entry) << "a break inside a block without an exception entry";
    plan.handler_entry = (int)(entry - ci.exception_table.data());
  }
  // Exception handlers are not part of a loop even when they jump backward (3.12 puts a with statement's
  // handler after the function body and jumps back from it).
  std::vector<bool> normal_flow = reachable_without_exceptions(ci);
  for (size_t j = 0; j < ci.instructions.size() && !plan.in_loop; ++j) {
    const Instruction& jump = ci.instructions[j];
    if (normal_flow[j] && ops.is_jump(jump.opcode) && jump.target >= 0 && jump.target <= state.pc && (int)j >= state.pc)
      plan.in_loop = true;
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
    KILN_ASSERT(ins.target > state.pc || plan.in_loop) << "a break at a backward jump outside a loop";
    plan.successors.push_back({ins.target, plan.consumed + ops.stack_effect(ins.opcode, ins.arg, true)});
  }
  std::unordered_set<const Var*> seen;
  for (int i = 0; i < depth; ++i) {
    const VarPtr& v = state.stack[i];
    plan.stack_null.push_back(v->is(VarKind::kNull));
    plan.stack_iterator.push_back(v->is(VarKind::kIterator));
    if (v->is(VarKind::kNull)) continue;
    std::string why = v->is(VarKind::kIterator) ? loop_iterator_unrebuildable(v, state, seen) : unrebuildable(v, seen);
    if (!why.empty()) {
      plan.why_not = "the stack holds " + why;
      return plan;
    }
  }
  // The handler copy and the eager continuation need the stack exactly as the original has it, and a NULL
  // below the consumed slots is not rebuilt by the break code (only a resume function's prologue re-pushes it).
  if (plan.in_loop || plan.handler_entry >= 0)
    for (int i = 0; i < depth - plan.consumed; ++i)
      if (state.stack[i]->is(VarKind::kNull)) {
        plan.why_not = "a call in progress below the break inside a loop or block (its NULL slot cannot be rebuilt)";
        return plan;
      }
  // Free variables (the last slots) are not locals: the resume function gets the same closure cells, and
  // the frame's own cells too (as free variables).
  size_t first_free = state.locals.size() - code->co_nfreevars;
  const char* kinds = PyBytes_AS_STRING(code->co_localspluskinds);
  int nargs = argument_slots(code);
  for (size_t i = 0; i < first_free; ++i) {
    bool cell = kinds[i] & kFastCell;
    VarPtr v = state.locals[i];
    if (cell && v && v->is(VarKind::kCell)) v = v->items[0];
    if (!v) {
      if (cell && (int)i < nargs) plan.cells_deleted.push_back((int)i);  // the cell holds the argument: empty it
      continue;
    }
    if (v->is(VarKind::kFunction)) {
      std::string why = plan_closure(v, state, kinds, (int)i, cell, plan);
      if (!why.empty()) {
        plan.why_not = "a local holds " + why;
        return plan;
      }
      if (!cell) plan.live_locals.push_back((int)i);
      continue;
    }
    std::string why = unrebuildable(v, seen);
    if (!why.empty()) {
      plan.why_not = "a local holds " + why;
      return plan;
    }
    (cell ? plan.cell_values : plan.live_locals).push_back((int)i);
  }
  // In the original's order, so that a resume function's break passes its locals in the order the first
  // break did and both resume in one code object (resume_code's cache key).
  std::stable_sort(plan.live_locals.begin(), plan.live_locals.end(),
                   [&](int a, int b) { return original_local(code, a) < original_local(code, b); });
  if (state.kwnames) {
    for (int k = state.pc - 1; k >= 0 && k >= state.pc - 2; --k)
      if (ci.instructions[k].opcode == ops.op("KW_NAMES")) plan.kwnames_const = ci.instructions[k].arg;
    if (plan.kwnames_const < 0) plan.why_not = "keyword names of the call not found";
  }
  return plan;
}

VarPtr break_values(const BreakPlan& plan, const BreakState& state) {
  std::vector<VarPtr> items;
  for (int i : plan.live_locals)
    if (!plan.function_local(i)) items.push_back(state.locals[i]);
  for (int i : plan.cell_values) {
    const VarPtr& v = state.locals[i];
    items.push_back(v->is(VarKind::kCell) ? v->items[0] : v);
  }
  // Traced autocast blocks are entered again after the graph, outermost first: each block's __exit__ carries
  // the one of the block around it (items[1]), which output_spec builds (enters) before it.
  std::vector<VarPtr> stack = state.stack;
  VarPtr outer;
  for (VarPtr& v : stack)
    if (is_traced_autocast_exit(v)) {
      VarPtr exit = make_method(v->value, v->items[0]);
      if (outer) exit->items.push_back(outer);
      v = outer = exit;
    }
  for (auto it = stack.rbegin(); it != stack.rend(); ++it) {
    const VarPtr& v = *it;
    if (v->is(VarKind::kNull)) continue;
    if (v->is(VarKind::kIterator))  // the break code makes it an iterator again (make_break_code)
      items.push_back(make_sequence(VarKind::kList, std::vector<VarPtr>(v->items.begin() + v->position, v->items.end())));
    else
      items.push_back(v);
  }
  return make_sequence(VarKind::kTuple, std::move(items));
}

}  // namespace kiln::trace
