#include "trace/transform_code.h"

#include "bytecode/bytecode.h"
#include "common/error.h"
#include "trace/bytecode_emitter.h"
#include "trace/code_layout.h"

namespace kiln::trace {

CallCode make_call_code(PyCodeObject* original, PyObject* program) {
  using bytecode::Instruction;
  const auto& ops = bytecode::opcodes();
  bytecode::CodeInstructions decoded = bytecode::decode(original);

  bytecode::CodeInstructions out;
  out.firstlineno = original->co_firstlineno;
  // Keep the prologue (COPY_FREE_VARS, MAKE_CELL..., RESUME): it builds the cells the loads below read.
  for (const Instruction& ins : decoded.instructions) {
    out.instructions.push_back(ins);
    out.instructions.back().target = -1;
    if (ins.opcode == ops.op("RESUME")) break;
  }
  KILN_ASSERT(!out.instructions.empty() && out.instructions.back().opcode == ops.op("RESUME"))
      << "no RESUME in the prologue of " << PyUnicode_AsUTF8(original->co_qualname);

  Emitter emitter{out, {}};
  emitter.pos.line = emitter.pos.end_line = original->co_firstlineno;
  auto emit = [&](const char* name, int arg) { emitter.emit(name, arg); };

  PyObject* consts = original->co_consts;
  Py_ssize_t program_index = PyTuple_GET_SIZE(consts);
  const bool v313 = PY_VERSION_HEX >= 0x030D0000;
  if (!v313) emit("PUSH_NULL", 0);
  emit("LOAD_CONST", (int)program_index);
  if (v313) emit("PUSH_NULL", 0);

  int nargs = argument_slots(original);
  const char* kinds = PyBytes_AS_STRING(original->co_localspluskinds);
  for (int i = 0; i < nargs; ++i) emit((kinds[i] & kFastCell) ? "LOAD_DEREF" : "LOAD_FAST", i);
  int nlocalsplus = (int)PyTuple_GET_SIZE(original->co_localsplusnames);
  int nfree = original->co_nfreevars;
  // Free variables pass their cells (3.13 loads a cell with LOAD_FAST): the program reads their contents,
  // and assigns them where the traced code did.
  for (int j = 0; j < nfree; ++j) emit(v313 ? "LOAD_FAST" : "LOAD_CLOSURE", nlocalsplus - nfree + j);
  int ncall = nargs + nfree;
  if (ops.op("PRECALL") >= 0) emit("PRECALL", ncall);
  emit("CALL", ncall);
  emit("RETURN_VALUE", 0);

  PyObject* new_consts = PyTuple_New(program_index + 1);
  for (Py_ssize_t i = 0; i < program_index; ++i) {
    Py_INCREF(PyTuple_GET_ITEM(consts, i));
    PyTuple_SET_ITEM(new_consts, i, PyTuple_GET_ITEM(consts, i));
  }
  Py_INCREF(program);
  PyTuple_SET_ITEM(new_consts, program_index, program);
  PyObject* kwargs = Py_BuildValue("{s:N}", "co_consts", new_consts);
  PyObject* code = bytecode::make_code(original, out, kwargs);
  Py_DECREF(kwargs);
  return CallCode{code, nargs, nfree};
}

}  // namespace kiln::trace
