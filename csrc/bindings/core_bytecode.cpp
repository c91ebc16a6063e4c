// kiln._core.bytecode: the bytecode layer seen from Python, for tests and debugging.
#include <pybind11/pybind11.h>

#include "bindings/core_register.h"
#include "bytecode/bytecode.h"
#include "common/error.h"

namespace py = pybind11;

namespace kiln::bindings {

namespace {
PyCodeObject* as_code(const py::object& obj) {
  KILN_CHECK(PyCode_Check(obj.ptr())) << "expected a code object, got "
                                      << py::str(py::type::of(obj)).cast<std::string>();
  return reinterpret_cast<PyCodeObject*>(obj.ptr());
}
}  // namespace

void register_bytecode(py::module_& m) {
  py::module_ bc = m.def_submodule("bytecode", "decode / assemble CPython bytecode (kiln::bytecode)");

  bc.def(
      "roundtrip",
      [](const py::object& code) {
        PyCodeObject* c = as_code(code);
        return py::reinterpret_steal<py::object>(bytecode::make_code(c, bytecode::decode(c), nullptr));
      },
      py::arg("code"), "decode + assemble + make_code: a new code object built from the decoded instructions");

  bc.def(
      "instructions",
      [](const py::object& code) {
        const bytecode::OpcodeTable& ops = bytecode::opcodes();
        bytecode::CodeInstructions ci = bytecode::decode(as_code(code));
        py::list out;
        for (const bytecode::Instruction& instr : ci.instructions)
          out.append(py::make_tuple(ops.name(instr.opcode), instr.arg, instr.target, instr.offset, instr.pos.line));
        return out;
      },
      py::arg("code"), "list of (opname, arg, target_index, offset, line); target_index is -1 for non-jumps");

  bc.def(
      "exception_table",
      [](const py::object& code) {
        bytecode::CodeInstructions ci = bytecode::decode(as_code(code));
        py::list out;
        for (const bytecode::ExceptionEntry& e : ci.exception_table)
          out.append(py::make_tuple(e.start, e.end, e.target, e.depth, e.lasti));
        return out;
      },
      py::arg("code"), "list of (start, end, target, depth, lasti) in instruction indices");

  bc.def(
      "stack_depth", [](const py::object& code) { return bytecode::stack_depth(bytecode::decode(as_code(code))); },
      py::arg("code"), "maximum value-stack depth computed from the instructions");

  bc.def(
      "format", [](const py::object& code) { return bytecode::format(bytecode::decode(as_code(code))); },
      py::arg("code"), "readable listing of the decoded instructions");

  // Editing from Python (tests): rebuild `code` from a list of (opname, arg, target_index) with the
  // original's positions for instructions taken by `source_index` (-1: no location), and the
  // exception table given in instruction indices.
  bc.def(
      "assemble_code",
      [](const py::object& code, const py::list& instructions, const py::list& exception_table,
         const py::object& replace_kwargs) {
        const bytecode::OpcodeTable& ops = bytecode::opcodes();
        PyCodeObject* c = as_code(code);
        bytecode::CodeInstructions original = bytecode::decode(c);
        bytecode::CodeInstructions ci;
        ci.firstlineno = original.firstlineno;
        for (const py::handle& item : instructions) {
          auto t = item.cast<py::tuple>();
          KILN_CHECK(t.size() == 4) << "assemble_code: each instruction is (opname, arg, target_index, source_index)";
          bytecode::Instruction instr;
          std::string name = t[0].cast<std::string>();
          instr.opcode = ops.op(name);
          KILN_CHECK(instr.opcode >= 0) << "assemble_code: this Python has no opcode " << name;
          instr.arg = t[1].cast<int>();
          instr.target = t[2].cast<int>();
          int source = t[3].cast<int>();
          if (source >= 0) {
            KILN_CHECK(source < static_cast<int>(original.instructions.size())) << "source_index out of range";
            instr.pos = original.instructions[source].pos;
          }
          ci.instructions.push_back(instr);
        }
        for (const py::handle& item : exception_table) {
          auto t = item.cast<py::tuple>();
          KILN_CHECK(t.size() == 5) << "assemble_code: each exception entry is (start, end, target, depth, lasti)";
          ci.exception_table.push_back(
              {t[0].cast<int>(), t[1].cast<int>(), t[2].cast<int>(), t[3].cast<int>(), t[4].cast<bool>()});
        }
        PyObject* kwargs = replace_kwargs.is_none() ? nullptr : replace_kwargs.ptr();
        return py::reinterpret_steal<py::object>(bytecode::make_code(c, ci, kwargs));
      },
      py::arg("code"), py::arg("instructions"), py::arg("exception_table"), py::arg("replace_kwargs") = py::none(),
      "build a code object from edited instructions (opname, arg, target_index, source_index)");

  bc.def(
      "opcode_info",
      [](const std::string& name) {
        const bytecode::OpcodeTable& ops = bytecode::opcodes();
        int op = ops.op(name);
        if (op < 0) return py::object(py::none());
        py::dict d;
        d["opcode"] = op;
        d["caches"] = ops.caches(op);
        d["has_arg"] = ops.has_arg(op);
        d["is_jump"] = ops.is_jump(op);
        d["is_backward_jump"] = ops.is_backward_jump(op);
        d["is_terminator"] = ops.is_terminator(op);
        return py::object(d);
      },
      py::arg("name"), "the opcode table's facts for one opcode name, or None when this Python lacks it");
}

}  // namespace kiln::bindings
