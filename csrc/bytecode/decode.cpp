// decode(): co_code (de-specialised) -> instruction list with EXTENDED_ARG folded into args, CACHE
// units dropped, jump offsets turned into instruction indices, and exception/line tables attached
// per instruction. Also format() for KILN_LOGS=bytecode.
#include <sstream>

#include "bytecode/bytecode.h"
#include "common/error.h"

namespace kiln::bytecode {

namespace {

struct Ref {
  PyObject* p;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  ~Ref() { Py_XDECREF(p); }
};

std::string_view bytes_attr(PyObject* code, const char* name, Ref& holder) {
  holder.p = PyObject_GetAttrString(code, name);
  if (!holder.p || !PyBytes_Check(holder.p)) {
    PyErr_Clear();
    KILN_CHECK(false) << "code object has no bytes attribute " << name;
  }
  return {PyBytes_AS_STRING(holder.p), static_cast<size_t>(PyBytes_GET_SIZE(holder.p))};
}

int extended_arg_prefixes(int arg) {
  if (arg < 0) return 3;  // sign-extended (never produced by CPython); keep the full 32-bit form
  int n = 0;
  for (unsigned rest = static_cast<unsigned>(arg) >> 8; rest != 0; rest >>= 8) ++n;
  return n;
}

}  // namespace

int instruction_size(int opcode, int arg) {
  const OpcodeTable& ops = opcodes();
  return (ops.has_arg(opcode) ? extended_arg_prefixes(arg) : 0) + 1 + ops.caches(opcode);
}

CodeInstructions decode(PyCodeObject* code) {
  KILN_CHECK(code && PyCode_Check(reinterpret_cast<PyObject*>(code))) << "decode() needs a code object";
  const OpcodeTable& ops = opcodes();
  PyObject* code_obj = reinterpret_cast<PyObject*>(code);
  Ref code_holder(nullptr), exc_holder(nullptr), line_holder(nullptr);
  std::string_view raw = bytes_attr(code_obj, "co_code", code_holder);
  std::string_view exc = bytes_attr(code_obj, "co_exceptiontable", exc_holder);
  std::string_view lines = bytes_attr(code_obj, "co_linetable", line_holder);
  KILN_CHECK(raw.size() % 2 == 0) << "co_code has an odd length";
  const int units = static_cast<int>(raw.size() / 2);

  CodeInstructions ci;
  Ref firstline(PyObject_GetAttrString(code_obj, "co_firstlineno"));
  KILN_CHECK(firstline.p) << "code object has no co_firstlineno";
  ci.firstlineno = static_cast<int>(PyLong_AsLong(firstline.p));

  // unit_index[u] = instruction covering code unit u (prefix, opcode or cache unit).
  std::vector<int> unit_index(units + 1, -1);
  std::vector<int> opcode_unit;  // per instruction: the unit holding the real opcode (after prefixes)
  unsigned extended = 0;
  int start = -1;
  for (int u = 0; u < units; ++u) {
    int op = ops.base(static_cast<unsigned char>(raw[2 * u]));
    unsigned arg = static_cast<unsigned char>(raw[2 * u + 1]);
    KILN_CHECK(op >= 0) << "unknown opcode " << static_cast<int>(static_cast<unsigned char>(raw[2 * u]))
                        << " at code unit " << u;
    if (start < 0) start = u;
    if (op == ops.extended_arg) {
      extended = (extended | arg) << 8;
      continue;
    }
    Instruction instr;
    instr.opcode = op;
    instr.arg = static_cast<int>(extended | arg);
    instr.offset = start;
    int index = static_cast<int>(ci.instructions.size());
    ci.instructions.push_back(instr);
    opcode_unit.push_back(u);
    int end = u + 1 + ops.caches(op);
    KILN_CHECK(end <= units) << ops.name(op) << " at unit " << u << " runs past the end of co_code";
    for (int k = start; k < end; ++k) unit_index[k] = index;
    u = end - 1;
    extended = 0;
    start = -1;
  }
  KILN_CHECK(start < 0) << "co_code ends inside an EXTENDED_ARG prefix";
  const int count = static_cast<int>(ci.instructions.size());
  unit_index[units] = count;  // one past the end: exception ranges may end there

  auto index_starting_at = [&](int unit, const char* what) {
    KILN_CHECK(unit >= 0 && unit <= units && unit_index[unit] >= 0 &&
               (unit == units || ci.instructions[unit_index[unit]].offset == unit))
        << what << " points at code unit " << unit << ", which does not start an instruction";
    return unit_index[unit];
  };

  for (int i = 0; i < count; ++i) {
    Instruction& instr = ci.instructions[i];
    if (!ops.is_jump(instr.opcode)) continue;
    int next = opcode_unit[i] + 1 + ops.caches(instr.opcode);
    int target_unit = ops.is_backward_jump(instr.opcode) ? next - instr.arg : next + instr.arg;
    instr.target = index_starting_at(target_unit, ops.name(instr.opcode));
    KILN_CHECK(instr.target < count) << ops.name(instr.opcode) << " jumps past the end of the code";
  }

  for (const RawExceptionEntry& raw_entry : decode_exception_table(exc)) {
    ExceptionEntry e;
    e.start = index_starting_at(raw_entry.start, "exception table start");
    e.end = index_starting_at(raw_entry.start + raw_entry.size, "exception table end");
    e.target = index_starting_at(raw_entry.target, "exception handler");
    e.depth = raw_entry.depth;
    e.lasti = raw_entry.lasti;
    KILN_CHECK(e.target < count && e.start < e.end) << "exception table entry out of range";
    ci.exception_table.push_back(e);
  }

  std::vector<Positions> positions = decode_line_table(lines, ci.firstlineno, units);
  int previous_line = -1;
  for (Instruction& instr : ci.instructions) {
    instr.pos = positions[instr.offset];
    instr.starts_line = instr.pos.line >= 0 && instr.pos.line != previous_line;
    if (instr.pos.line >= 0) previous_line = instr.pos.line;
  }
  return ci;
}

int instruction_at_offset(const CodeInstructions& ci, int unit) {
  // Instructions are laid out in order; decoded offsets are increasing, created ones are -1.
  int found = -1;
  for (int i = 0; i < static_cast<int>(ci.instructions.size()); ++i) {
    const Instruction& instr = ci.instructions[i];
    if (instr.offset < 0) continue;
    if (instr.offset > unit) break;
    found = i;
  }
  if (found < 0) return -1;
  const Instruction& instr = ci.instructions[found];
  return unit < instr.offset + instruction_size(instr.opcode, instr.arg) ? found : -1;
}

std::string format(const CodeInstructions& ci) {
  const OpcodeTable& ops = opcodes();
  std::vector<bool> is_target(ci.instructions.size(), false);
  for (const Instruction& instr : ci.instructions)
    if (instr.target >= 0 && instr.target < static_cast<int>(is_target.size())) is_target[instr.target] = true;
  for (const ExceptionEntry& e : ci.exception_table)
    if (e.target >= 0 && e.target < static_cast<int>(is_target.size())) is_target[e.target] = true;

  std::ostringstream out;
  for (size_t i = 0; i < ci.instructions.size(); ++i) {
    const Instruction& instr = ci.instructions[i];
    out << (instr.starts_line ? std::to_string(instr.pos.line) : std::string()) << '\t' << i << '\t'
        << (is_target[i] ? ">> " : "   ") << '@' << instr.offset << '\t' << ops.name(instr.opcode);
    if (ops.has_arg(instr.opcode)) out << ' ' << instr.arg;
    if (instr.target >= 0) out << " (to " << instr.target << ')';
    out << '\n';
  }
  if (!ci.exception_table.empty()) {
    out << "exception table:\n";
    for (const ExceptionEntry& e : ci.exception_table)
      out << "  " << e.start << " to " << e.end << " -> " << e.target << " [" << e.depth << ']'
          << (e.lasti ? " lasti" : "") << '\n';
  }
  return out.str();
}

}  // namespace kiln::bytecode
