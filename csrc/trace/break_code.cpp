// The code a graph break runs (graph_break.h): the frame's transformed code, which calls the graph so far,
// rebuilds the stack and locals, runs the break instruction in CPython and hands over to a resume function;
// and the resume functions' code. Both are assembled from the original's decoded instructions.
#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <unordered_map>

#include "common/error.h"
#include "frame/cpython_shim.h"
#include "trace/bytecode_emitter.h"
#include "trace/code_layout.h"
#include "trace/graph_break.h"

namespace kiln::trace {

using bytecode::Instruction;

namespace {

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

// Appends a copy of `ci`'s body (after its prologue) with the exception entries that cover it; `fix` adjusts
// each copied instruction's argument (locals renumbered). Returns the shift: copy index = original index + shift.
int append_body_copy(bytecode::CodeInstructions& out, const bytecode::CodeInstructions& ci,
                     const std::function<void(Instruction&)>& fix) {
  int first = prologue_end(ci) + 1;
  int shift = (int)out.instructions.size() - first;
  for (size_t i = first; i < ci.instructions.size(); ++i) {
    Instruction ins = ci.instructions[i];
    ins.offset = -1;
    if (ins.target >= 0) ins.target += shift;
    if (fix) fix(ins);
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
  return shift;
}

// Where a resume code came from: the first original code (what the user wrote), where that code's body sits in
// the copy, and how the locals map back; and whether its break site is inside a loop.
struct ResumeOrigin {
  PyCodeObject* original = nullptr;  // kept alive by the resume-code cache
  int shift = 0;                     // resume index = original index + shift
  std::vector<int> original_local;   // resume local -> original local (-1: a stack argument)
  bool in_loop = false;
};

std::unordered_map<PyObject*, ResumeOrigin>& resume_origins() {
  static std::unordered_map<PyObject*, ResumeOrigin> origins;  // resume codes live for the process
  return origins;
}

// A function of kiln._tracing (new reference) that the generated code calls.
PyObject* tracing_function(const char* name) {
  PyObject* tracing = PyImport_ImportModule("kiln._tracing");
  PyObject* fn = tracing ? PyObject_GetAttrString(tracing, name) : nullptr;
  Py_XDECREF(tracing);
  if (!fn) {
    PyErr_Clear();
    KILN_UNSUPPORTED() << "kiln._tracing." << name << " is missing";
  }
  return fn;
}

// code.replace(...) with `kwargs` (stolen) around the assembled instructions.
PyObject* make_code_stealing(PyCodeObject* original, const bytecode::CodeInstructions& out, PyObject* kwargs) {
  struct Release {
    PyObject* kwargs;
    ~Release() { Py_DECREF(kwargs); }
  } release{kwargs};
  return bytecode::make_code(original, out, kwargs);
}

// The localsplus indices of the frame's cells (arguments captured by nested functions included), in order:
// with the free variables after them, the closure a resume function is made with.
std::vector<int> cell_slots(PyCodeObject* code) {
  std::vector<int> cells;
  const char* kinds = PyBytes_AS_STRING(code->co_localspluskinds);
  for (int i = 0; i < (int)PyTuple_GET_SIZE(code->co_localsplusnames); ++i)
    if (kinds[i] & kFastCell) cells.push_back(i);
  return cells;
}

}  // namespace

bool resume_needs_closure(PyCodeObject* code) { return code->co_nfreevars > 0 || !cell_slots(code).empty(); }

int original_local(PyCodeObject* code, int local) {
  auto it = resume_origins().find((PyObject*)code);
  if (it == resume_origins().end()) return local;
  return it->second.original_local.at(local);
}

bool is_resume_code(PyObject* code) { return resume_origins().count(code) > 0; }

bool is_loop_resume_code(PyObject* code) {
  auto it = resume_origins().find(code);
  return it != resume_origins().end() && it->second.in_loop;
}

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
  // Constants appended to the original's: the program, the resume functions, then these.
  std::vector<PyObject*> extra = {program};
  extra.insert(extra.end(), resume_functions.begin(), resume_functions.end());
  const int program_const = (int)PyTuple_GET_SIZE(original->co_consts);
  int grad_setter_const = -1, nesting_const = -1;
  std::vector<PyObject*> owned;  // the helpers among `extra`
  struct Release {
    std::vector<PyObject*>& owned;
    ~Release() {
      for (PyObject* o : owned) Py_DECREF(o);
    }
  } release{owned};
  if (plan.restore_grad_mode >= 0) {
    owned.push_back(tracing_function("set_grad_enabled"));
    grad_setter_const = program_const + (int)extra.size();
    extra.push_back(owned.back());
    extra.push_back(plan.restore_grad_mode ? Py_True : Py_False);
  }
  if (plan.in_loop) {
    owned.push_back(tracing_function("resume_nesting_ok"));
    nesting_const = program_const + (int)extra.size();
    extra.push_back(owned.back());
  }

  // values = program(arguments..., free variables...)
  int nargs = argument_slots(original);
  if (kCallableAfterNull) e.emit("PUSH_NULL");
  e.emit("LOAD_CONST", program_const);
  if (!kCallableAfterNull) e.emit("PUSH_NULL");
  int nlocalsplus = (int)PyTuple_GET_SIZE(original->co_localsplusnames);
  int nfree = original->co_nfreevars;
  const char* kinds = PyBytes_AS_STRING(original->co_localspluskinds);
  const std::vector<int> cells = cell_slots(original);
  for (int i = 0; i < nargs; ++i) e.emit((kinds[i] & kFastCell) ? "LOAD_DEREF" : "LOAD_FAST", i);  // past MAKE_CELL
  // Free variables pass their cells (3.13 loads a cell with LOAD_FAST): the program reads their contents,
  // and assigns them where the traced code did.
  for (int j = 0; j < nfree; ++j) e.emit(PY_VERSION_HEX >= 0x030D0000 ? "LOAD_FAST" : "LOAD_CLOSURE", nlocalsplus - nfree + j);
  e.call(nargs + nfree);
  // Arguments the original had already unbound (a resume function's stack arguments, a `del`) must not
  // stay bound here: eager would have let them go, and a frame kept by a traceback would keep them.
  for (int i = 0; i < nargs; ++i)
    if (!(kinds[i] & kFastCell) && std::find(plan.live_locals.begin(), plan.live_locals.end(), i) == plan.live_locals.end())
      e.emit("DELETE_FAST", i);
  for (int cell : plan.cells_deleted) e.emit("DELETE_DEREF", cell);

  // Unpack: locals on top (stored first), then the non-NULL stack slots, bottom one deepest.
  int below = (int)plan.stack_null.size() - plan.consumed;
  int nonnull_total = 0, nonnull_below = 0;
  for (int i = 0; i < (int)plan.stack_null.size(); ++i)
    if (!plan.stack_null[i]) {
      ++nonnull_total;
      if (i < below) ++nonnull_below;
    }
  int nfunction_locals = 0;
  for (int local : plan.live_locals) nfunction_locals += plan.function_local(local);
  int nvalues = (int)plan.live_locals.size() - nfunction_locals + (int)plan.cell_values.size() + nonnull_total;
  if (nvalues == 0)
    e.emit("POP_TOP");
  else
    e.emit("UNPACK_SEQUENCE", nvalues);
  for (int local : plan.live_locals)
    if (!plan.function_local(local)) e.emit("STORE_FAST", local);
  for (int cell : plan.cell_values) e.emit("STORE_DEREF", cell);
  // Functions made in the trace around the frame's cells: made again here, around the real cells.
  for (const BreakPlan::Closure& closure : plan.closures) {
    if (closure.same_as >= 0) {
      const BreakPlan::Closure& first = plan.closures[closure.same_as];
      e.emit(first.in_cell ? "LOAD_DEREF" : "LOAD_FAST", first.slot);
    } else {
      if (PY_VERSION_HEX >= 0x030D0000) KILN_UNSUPPORTED() << "functions made in traced code, at a break on this Python";
      PyObject* fn = closure.function;
      int flags = 0x08;
      for (auto [part, flag] : {std::pair{PyFunction_GetDefaults(fn), 0x01}, std::pair{PyFunction_GetKwDefaults(fn), 0x02}})
        if (part) {
          flags |= flag;
          e.emit("LOAD_CONST", program_const + (int)extra.size());
          extra.push_back(part);
        }
      for (int cell : closure.cells) e.emit("LOAD_CLOSURE", cell);
      e.emit("BUILD_TUPLE", (int)closure.cells.size());
      e.emit("LOAD_CONST", program_const + (int)extra.size());
      extra.push_back(PyFunction_GetCode(fn));
      e.emit("MAKE_FUNCTION", flags);
    }
    e.emit(closure.in_cell ? "STORE_DEREF" : "STORE_FAST", closure.slot);
  }
  // The consumed slots' NULLs go back in place (the NULLs below them are re-pushed by the resume code).
  int height = nonnull_total;
  for (int k = 0; k < plan.consumed; ++k) {
    if (!plan.stack_null[below + k]) continue;
    int position = nonnull_below + k;  // final index from the bottom of the rebuilt part
    e.emit("PUSH_NULL");
    ++height;
    e.sink_top(height - position);
  }
  // Loop iterators came as lists of the items they had left: iterators again, where the original has them.
  for (int i = 0; i < (int)plan.stack_iterator.size(); ++i) {
    if (!plan.stack_iterator[i]) continue;
    KILN_ASSERT(height == (int)plan.stack_null.size()) << "a loop iterator on a stack rebuilt without its NULLs";
    e.at_depth(height - i, [&] { e.emit("GET_ITER"); });
  }

  // The original instruction, as CPython runs it.
  int break_start = (int)out.instructions.size();
  if (plan.kwnames_const >= 0) e.emit("KW_NAMES", plan.kwnames_const);
  if (kHasPrecall && ops.name(broken.opcode) == std::string("CALL")) e.emit("PRECALL", broken.arg);
  Instruction copy = broken;
  copy.offset = -1;
  copy.target = -1;
  // Its jump now goes forward, to the second tail (3.11's loop conditions jump backward).
  std::string name = ops.name(broken.opcode);
  if (size_t at = name.find("_BACKWARD_"); at != std::string::npos && ops.is_jump(broken.opcode)) {
    copy.opcode = ops.op(name.replace(at, 10, "_FORWARD_"));
    KILN_ASSERT(copy.opcode >= 0) << "no forward form of " << ops.name(broken.opcode);
  }
  out.instructions.push_back(copy);
  int jump_index = (int)out.instructions.size() - 1;
  std::optional<bytecode::ExceptionEntry> break_cover;
  if (plan.restore_grad_mode >= 0 || plan.handler_entry >= 0) {
    // Inside grad-mode blocks: a handler that restores the mode; inside other blocks: the original handler, in
    // the copy of the body appended below (the stack here is the original's, so its depth holds).
    bytecode::ExceptionEntry cover;
    cover.start = break_start;
    cover.end = jump_index + 1;
    if (plan.handler_entry >= 0) {
      cover.depth = ci.exception_table[plan.handler_entry].depth;
      cover.lasti = ci.exception_table[plan.handler_entry].lasti;
    }
    break_cover = cover;
  }

  // One tail per successor: return resume(stack..., locals...).
  std::vector<std::pair<int, int>> jumps_into_copy;  // (emitted jump, original target)
  for (size_t s = 0; s < plan.successors.size(); ++s) {
    if (s == 1) out.instructions[jump_index].target = (int)out.instructions.size();
    int nitems = nonnull_below + plan.successors[s].pushed;
    if (plan.in_loop) {
      // Each iteration nests one more resume call: deep down, the loop goes on eagerly in the copy of the body.
      e.callable_under(nesting_const, 0);
      e.call(0);
      jumps_into_copy.emplace_back(e.jump_forward_if_false(), plan.successors[s].target);
      for (int i = 0; i < below; ++i)
        if (plan.stack_iterator[i]) e.at_depth(nitems - i, [&] { e.list_from_iterator(); });
    }
    if (nfree == 0 && cells.empty()) {
      e.callable_under(program_const + 1 + (int)s, nitems);
    } else {
      // A closure needs the frame's own cells: the function is made here, from the resume code, around the
      // frame's cells and free variables.
      if (!kCallableAfterNull) KILN_UNSUPPORTED() << "graph breaks in closures on this Python";
      e.emit("PUSH_NULL");
      e.sink_top(nitems + 1);
      for (int cell : cells) e.emit("LOAD_CLOSURE", cell);
      for (int j = 0; j < nfree; ++j) e.emit("LOAD_CLOSURE", nlocalsplus - nfree + j);
      e.emit("BUILD_TUPLE", (int)cells.size() + nfree);
      e.emit("LOAD_CONST", program_const + 1 + (int)s);
      e.emit("MAKE_FUNCTION", 0x08);
      e.sink_top(nitems + 1);
    }
    for (int local : plan.live_locals) e.emit("LOAD_FAST", local);
    e.call(nitems + (int)plan.live_locals.size());
    e.emit("RETURN_VALUE");
  }
  if (plan.restore_grad_mode >= 0) {
    // handler: [exc] -> torch._C._set_grad_enabled(mode) -> re-raise exc
    break_cover->target = (int)out.instructions.size();
    e.callable_under(grad_setter_const, 0);
    e.emit("LOAD_CONST", grad_setter_const + 1);
    e.call(1);
    e.emit("POP_TOP");
    e.emit("RERAISE", 0);
  }
  if (plan.in_loop || plan.handler_entry >= 0) {
    int shift = append_body_copy(out, ci, nullptr);
    for (const auto& [index, target] : jumps_into_copy) out.instructions[index].target = target + shift;
    if (plan.handler_entry >= 0) break_cover->target = ci.exception_table[plan.handler_entry].target + shift;
  }
  if (break_cover) out.exception_table.push_back(*break_cover);
  // CPython looks entries up in order of their start.
  std::stable_sort(out.exception_table.begin(), out.exception_table.end(),
                   [](const bytecode::ExceptionEntry& a, const bytecode::ExceptionEntry& b) { return a.start < b.start; });

  PyObject* consts = tuple_plus(original->co_consts, extra);
  return make_code_stealing(original, out, Py_BuildValue("{s:N}", "co_consts", consts));
}

PyObject* resume_code(PyCodeObject* original, const bytecode::CodeInstructions& ci, const BreakPlan& plan,
                      const BreakSuccessor& successor) {
  const auto& ops = bytecode::opcodes();
  auto origin = resume_origins().find((PyObject*)original);
  if (origin != resume_origins().end()) {
    // A break in a resume function's frame: the same break site in the first original code, so that every
    // iteration of a loop resumes in one code object.
    const ResumeOrigin& from = origin->second;
    BreakPlan mapped;  // the layout fields read below
    mapped.consumed = plan.consumed;
    mapped.stack_null = plan.stack_null;
    mapped.stack_iterator = plan.stack_iterator;
    mapped.in_loop = plan.in_loop;
    for (int local : plan.live_locals) {
      int o = from.original_local.at(local);
      KILN_ASSERT(o >= 0) << "a resume function's stack argument is live at a break";
      mapped.live_locals.push_back(o);
    }
    bytecode::CodeInstructions first_ci = bytecode::decode(from.original);
    BreakSuccessor mapped_successor{successor.target - from.shift, successor.pushed};
    KILN_ASSERT(mapped_successor.target > prologue_end(first_ci) &&
                mapped_successor.target < (int)first_ci.instructions.size())
        << "a resume target outside the copy of the original body";
    return resume_code(from.original, first_ci, mapped, mapped_successor);
  }
  // The layout: which slots of the resume stack are NULL or loop iterators, and which locals arrive as arguments.
  int below = (int)plan.stack_null.size() - plan.consumed;
  std::vector<char> stack_kind;  // 'N' NULL, 'i' loop iterator (passed as a list), 'v' value
  for (int i = 0; i < below; ++i)
    stack_kind.push_back(plan.stack_null[i] ? 'N' : i < (int)plan.stack_iterator.size() && plan.stack_iterator[i] ? 'i' : 'v');
  stack_kind.insert(stack_kind.end(), successor.pushed, 'v');
  std::string key = std::to_string((uintptr_t)original) + "@" + std::to_string(successor.target) + ":";
  key.append(stack_kind.begin(), stack_kind.end());
  for (int local : plan.live_locals) key += "," + std::to_string(local);
  struct Cached {
    PyObject* original;
    PyObject* code;
  };
  static std::map<std::string, Cached> cache;  // entries live for the process, like the code they copy
  auto hit = cache.find(key);
  if (hit != cache.end()) return hit->second.code;

  // Arguments: the non-NULL stack slots, then the live locals; the other locals follow as plain locals.
  // The original's cells (arguments captured by nested functions included) become free variables.
  PyObject* varnames = PyCode_GetVarnames(original);
  KILN_ASSERT(varnames) << "co_varnames";
  int nvarnames = (int)PyTuple_GET_SIZE(varnames);
  const char* kinds = PyBytes_AS_STRING(original->co_localspluskinds);
  const std::vector<int> cells = cell_slots(original);
  std::vector<PyObject*> names;
  std::vector<int> new_index(nvarnames, -1);
  std::vector<int> stack_args;  // argument index for each resume stack slot (-1 = NULL)
  for (char kind : stack_kind) {
    if (kind == 'N') {
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
    if (new_index[i] < 0 && !(kinds[i] & kFastCell)) {
      new_index[i] = (int)names.size();
      names.push_back(Py_NewRef(PyTuple_GET_ITEM(varnames, i)));
    }
  Py_DECREF(varnames);
  // Free variables: the original's cells, then its own free variables.
  int nfree = original->co_nfreevars;
  int nlocalsplus = (int)PyTuple_GET_SIZE(original->co_localsplusnames);
  std::vector<int> new_slot(nlocalsplus, -1);  // original localsplus index -> resume localsplus index
  for (int i = 0; i < nvarnames; ++i) new_slot[i] = new_index[i];
  PyObject* new_freevars = PyTuple_New(cells.size() + nfree);
  for (size_t k = 0; k < cells.size(); ++k) {
    new_slot[cells[k]] = (int)(names.size() + k);
    PyTuple_SET_ITEM(new_freevars, k, Py_NewRef(PyTuple_GET_ITEM(original->co_localsplusnames, cells[k])));
  }
  for (int j = 0; j < nfree; ++j) {
    new_slot[nlocalsplus - nfree + j] = (int)(names.size() + cells.size() + j);
    PyTuple_SET_ITEM(new_freevars, cells.size() + j,
                     Py_NewRef(PyTuple_GET_ITEM(original->co_localsplusnames, nlocalsplus - nfree + j)));
  }
  int nclosure = (int)cells.size() + nfree;
  PyObject* new_varnames = PyTuple_New(names.size());
  for (size_t i = 0; i < names.size(); ++i) PyTuple_SET_ITEM(new_varnames, i, names[i]);

  bytecode::CodeInstructions out;
  out.firstlineno = original->co_firstlineno;
  const Instruction& target = ci.instructions.at(successor.target);
  Emitter e{out, target.pos};
  if (nclosure > 0) e.emit("COPY_FREE_VARS", nclosure);
  e.emit("RESUME", 0);
  for (size_t i = 0; i < stack_args.size(); ++i) {
    if (stack_args[i] < 0) {
      e.emit("PUSH_NULL");
      continue;
    }
    e.emit("LOAD_FAST", stack_args[i]);
    if (stack_kind[i] == 'i') e.emit("GET_ITER");  // a loop iterator's items left
  }
  // Eager holds these values only on the stack: a local copy would outlive them (an exception raised
  // from the stack would reach itself through its traceback's frame, a cycle that eager never makes).
  for (int arg : stack_args)
    if (arg >= 0) e.emit("DELETE_FAST", arg);
  int jump = e.emit("JUMP_FORWARD", 0);
  auto remap = [&](int index) {
    KILN_ASSERT(index >= 0 && index < nlocalsplus && new_slot[index] >= 0) << "local index " << index << " out of range";
    return new_slot[index];
  };
  const int load_pair[] = {ops.op("LOAD_FAST_LOAD_FAST"), ops.op("STORE_FAST_LOAD_FAST"),
                           ops.op("STORE_FAST_STORE_FAST")};
  int shift = append_body_copy(out, ci, [&](Instruction& ins) {
    bool pair = false;
    for (int op : load_pair) pair = pair || (op >= 0 && ins.opcode == op);
    if (pair) {
      int hi = remap(ins.arg >> 4), lo = remap(ins.arg & 15);
      if (hi > 15 || lo > 15) KILN_UNSUPPORTED() << "a resume function whose locals do not fit a paired load";
      ins.arg = (hi << 4) | lo;
    } else if (ops.has_local(ins.opcode) || ops.has_free(ins.opcode)) {
      ins.arg = remap(ins.arg);  // cells moved to the free variables, locals behind the stack arguments
    }
  });
  out.instructions[jump].target = successor.target + shift;

  std::string qualname = std::string(PyUnicode_AsUTF8(original->co_qualname)) + KILN_RESUME_QUALNAME_MARKER +
                         std::to_string(target.pos.line) + ">";
  int flags = original->co_flags & ~(CO_VARARGS | CO_VARKEYWORDS);
  PyObject* kwargs = Py_BuildValue("{s:N,s:N,s:N,s:i,s:i,s:i,s:i,s:i,s:s}", "co_varnames", new_varnames, "co_freevars",
                                   new_freevars, "co_cellvars", PyTuple_New(0), "co_argcount", nargs,
                                   "co_posonlyargcount", 0, "co_kwonlyargcount", 0, "co_nlocals",
                                   (int)names.size(), "co_flags", flags, "co_qualname", qualname.c_str());
  PyObject* code = make_code_stealing(original, out, kwargs);
  cache[key] = Cached{Py_NewRef((PyObject*)original), code};
  ResumeOrigin& made = resume_origins()[code];
  made.original = original;
  made.shift = shift;
  made.original_local.assign(names.size(), -1);
  for (int i = 0; i < nvarnames; ++i)
    if (new_index[i] >= 0) made.original_local[new_index[i]] = i;
  made.in_loop = plan.in_loop;
  return code;
}

}  // namespace kiln::trace
