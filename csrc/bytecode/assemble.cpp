// assemble(): instruction list -> co_code, co_exceptiontable, co_linetable, co_stacksize; and
// make_code(), which puts them into a copy of the original code object.
//
// Jump arguments are relative, in code units, from the end of the jump (its caches included), and
// backward jumps count backward. A jump's EXTENDED_ARG prefixes change the distances of the jumps
// around it, so sizes are recomputed until nothing changes. Distances only grow when a size grows,
// so starting every jump at its smallest size and only growing reaches the least fixpoint — the
// layout CPython's own assembler produces.
#include "bytecode/bytecode.h"
#include "common/error.h"
#include "common/log.h"

namespace kiln::bytecode {

namespace {

// Same location -> one line-table run. 3.12+ assemblers merge equal neighbours; 3.11 writes one run
// per instruction, and matching that keeps rebuilt tables byte-equal to the compiler's.
#if PY_VERSION_HEX >= 0x030C0000
constexpr bool kMergeEqualLocations = true;
#else
constexpr bool kMergeEqualLocations = false;
#endif

int jump_distance(const OpcodeTable& ops, const Instruction& instr, int end_unit, int target_unit) {
  int distance = ops.is_backward_jump(instr.opcode) ? end_unit - target_unit : target_unit - end_unit;
  KILN_CHECK(distance >= 0) << ops.name(instr.opcode) << " cannot reach its target "
                            << (ops.is_backward_jump(instr.opcode) ? "(a backward jump must go back)"
                                                                    : "(a forward jump must go forward)")
                            << ": use the jump opcode of the other direction";
  return distance;
}

// Layouts the interpreter's fast paths assume without checking; breaking one crashes or silently
// changes behaviour, so assemble() refuses it. Rules naming an opcode this Python lacks do not apply.
struct MustFollowRule {
  const char* first;
  const char* next;
  const char* why;
  int min_version;  // PY_VERSION_HEX from which the rule holds
};
constexpr MustFollowRule kMustFollow[] = {
    {"PRECALL", "CALL", "3.11's specialised PRECALLs perform the call and skip the CALL after them", 0},
    {"YIELD_VALUE", "RESUME", "gen.throw()/close() find a `yield from` by the RESUME after the yield", 0},
    {"END_FOR", "POP_TOP", "3.13's FOR_ITER skips both END_FOR and POP_TOP when the iterator ends", 0x030D0000},
};
struct JumpTargetRule {
  const char* jump;
  const char* target;
  const char* why;
};
constexpr JumpTargetRule kJumpTargetMustBe[] = {
    {"FOR_ITER", "END_FOR", "3.12+ FOR_ITER skips the instruction at its target when the iterator ends"},
};

void check_layout_rules(const OpcodeTable& ops, const std::vector<Instruction>& instrs) {
  const int n = static_cast<int>(instrs.size());
  for (const MustFollowRule& rule : kMustFollow) {
    int first = ops.op(rule.first), next = ops.op(rule.next);
    if (first < 0 || next < 0 || PY_VERSION_HEX < rule.min_version) continue;
    for (int i = 0; i < n; ++i)
      KILN_CHECK(instrs[i].opcode != first || (i + 1 < n && instrs[i + 1].opcode == next))
          << "instruction " << i << ": " << rule.first << " must be followed directly by " << rule.next << " ("
          << rule.why << ")";
  }
  for (const JumpTargetRule& rule : kJumpTargetMustBe) {
    int jump = ops.op(rule.jump), target = ops.op(rule.target);
    if (jump < 0 || target < 0) continue;
    for (int i = 0; i < n; ++i)
      KILN_CHECK(instrs[i].opcode != jump || instrs[instrs[i].target].opcode == target)
          << "instruction " << i << ": " << rule.jump << " must jump to " << rule.target << " (" << rule.why << ")";
  }
}

void emit_unit(std::string& out, int opcode, int arg_byte) {
  out.push_back(static_cast<char>(opcode));
  out.push_back(static_cast<char>(arg_byte & 0xff));
}

}  // namespace

Assembled assemble(const CodeInstructions& ci, int firstlineno) {
  const OpcodeTable& ops = opcodes();
  const std::vector<Instruction>& instrs = ci.instructions;
  const int n = static_cast<int>(instrs.size());
  KILN_CHECK(n > 0) << "cannot assemble an empty instruction list";

  std::vector<int> sizes(n), offsets(n + 1), args(n);
  for (int i = 0; i < n; ++i) {
    const Instruction& instr = instrs[i];
    KILN_CHECK(ops.info(instr.opcode).name && ops.base(instr.opcode) == instr.opcode)
        << "instruction " << i << " has opcode " << instr.opcode << ", which is not a base opcode of this Python";
    KILN_CHECK(instr.opcode != ops.extended_arg && instr.opcode != ops.cache)
        << "instruction " << i << ": EXTENDED_ARG and CACHE are implicit, do not add them";
    if (ops.is_jump(instr.opcode)) {
      KILN_CHECK(instr.target >= 0 && instr.target < n)
          << "jump " << ops.name(instr.opcode) << " at " << i << " has target " << instr.target << " of " << n;
      args[i] = 0;
    } else {
      KILN_CHECK(ops.has_arg(instr.opcode) || (instr.arg >= 0 && instr.arg < 256))
          << ops.name(instr.opcode) << " takes no argument but has " << instr.arg;
      args[i] = instr.arg;
    }
    sizes[i] = instruction_size(instr.opcode, args[i]);
  }

  check_layout_rules(ops, instrs);

  for (bool changed = true; changed;) {
    changed = false;
    offsets[0] = 0;
    for (int i = 0; i < n; ++i) offsets[i + 1] = offsets[i] + sizes[i];
    for (int i = 0; i < n; ++i) {
      if (!ops.is_jump(instrs[i].opcode)) continue;
      args[i] = jump_distance(ops, instrs[i], offsets[i + 1], offsets[instrs[i].target]);
      int size = instruction_size(instrs[i].opcode, args[i]);
      if (size > sizes[i]) {
        sizes[i] = size;
        changed = true;
      }
    }
  }

  Assembled out;
  out.code.reserve(2 * offsets[n]);
  for (int i = 0; i < n; ++i) {
    const int opcode = instrs[i].opcode;
    const int caches = ops.caches(opcode);
    const unsigned arg = static_cast<unsigned>(args[i]);
    for (int prefix = sizes[i] - 1 - caches; prefix > 0; --prefix)
      emit_unit(out.code, ops.extended_arg, static_cast<int>(arg >> (8 * prefix)));
    emit_unit(out.code, opcode, static_cast<int>(arg));
    for (int c = 0; c < caches; ++c) emit_unit(out.code, ops.cache, 0);
  }

  std::vector<RawExceptionEntry> raw_entries;
  for (const ExceptionEntry& e : ci.exception_table) {
    KILN_CHECK(e.start >= 0 && e.start < e.end && e.end <= n && e.target >= 0 && e.target < n)
        << "exception entry [" << e.start << ", " << e.end << ") -> " << e.target << " out of range (" << n
        << " instructions)";
    raw_entries.push_back({offsets[e.start], offsets[e.end] - offsets[e.start], offsets[e.target], e.depth, e.lasti});
  }
  out.exception_table = encode_exception_table(raw_entries);

  std::vector<LocationRun> runs;
  for (int i = 0; i < n; ++i) {
    if (kMergeEqualLocations && !runs.empty() && runs.back().pos == instrs[i].pos)
      runs.back().units += sizes[i];
    else
      runs.push_back({instrs[i].pos, sizes[i]});
  }
  out.line_table = encode_line_table(runs, firstlineno);
  out.stacksize = stack_depth(ci);
  return out;
}

PyObject* make_code(PyCodeObject* original, const CodeInstructions& ci, PyObject* replace_kwargs) {
  KILN_CHECK(original && PyCode_Check(reinterpret_cast<PyObject*>(original))) << "make_code() needs a code object";
  KILN_CHECK(!replace_kwargs || PyDict_Check(replace_kwargs)) << "make_code(): replace_kwargs must be a dict";
  PyObject* kwargs = replace_kwargs ? PyDict_Copy(replace_kwargs) : PyDict_New();
  KILN_ASSERT(kwargs) << "out of memory";
  // Everything below owns `kwargs`; one exit path releases it.
  auto fail = [&](const std::string& what) -> PyObject* {
    Py_DECREF(kwargs);
    PyErr_Clear();
    KILN_CHECK(false) << what;
    return nullptr;
  };
  for (const char* computed : {"co_code", "co_exceptiontable", "co_linetable"})
    if (PyDict_GetItemString(kwargs, computed))
      return fail(std::string("make_code(): ") + computed + " is computed from the instructions; do not pass it");

  int firstlineno = ci.firstlineno;
  if (PyObject* given = PyDict_GetItemString(kwargs, "co_firstlineno")) firstlineno = PyLong_AsLong(given);
  Assembled a;
  try {
    a = assemble(ci, firstlineno);
  } catch (...) {
    Py_DECREF(kwargs);
    throw;
  }
  int stacksize = a.stacksize;
  if (PyObject* given = PyDict_GetItemString(kwargs, "co_stacksize"))
    stacksize = std::max<int>(stacksize, PyLong_AsLong(given));

  struct Field {
    const char* name;
    PyObject* value;
  } fields[] = {
      {"co_code", PyBytes_FromStringAndSize(a.code.data(), a.code.size())},
      {"co_exceptiontable", PyBytes_FromStringAndSize(a.exception_table.data(), a.exception_table.size())},
      {"co_linetable", PyBytes_FromStringAndSize(a.line_table.data(), a.line_table.size())},
      {"co_stacksize", PyLong_FromLong(stacksize)},
  };
  bool ok = true;
  for (const Field& f : fields) {
    ok = ok && f.value && PyDict_SetItemString(kwargs, f.name, f.value) == 0;
    Py_XDECREF(f.value);
  }
  if (!ok) return fail("make_code(): cannot build the replace() arguments");

  PyObject* replace = PyObject_GetAttrString(reinterpret_cast<PyObject*>(original), "replace");
  PyObject* empty = PyTuple_New(0);
  PyObject* result = (replace && empty) ? PyObject_Call(replace, empty, kwargs) : nullptr;
  Py_XDECREF(replace);
  Py_XDECREF(empty);
  if (!result) {
    std::string message = "code.replace() failed";
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (value) {
      PyObject* s = PyObject_Str(value);
      if (s && PyUnicode_Check(s)) message += std::string(": ") + PyUnicode_AsUTF8(s);
      Py_XDECREF(s);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return fail(message);
  }
  Py_DECREF(kwargs);
  KILN_LOG(bytecode) << "rebuilt code object " << PyUnicode_AsUTF8(reinterpret_cast<PyCodeObject*>(result)->co_name)
                     << " (stack size " << stacksize << "):\n"
                     << format(ci);
  return result;
}

}  // namespace kiln::bytecode
