#pragma once
// Instruction emission for the code kiln generates (transformed frames, resume functions, call stubs):
// opcodes by name for the running Python, and the stack idioms the generators share.
#include <Python.h>

#include <functional>

#include "bytecode/bytecode.h"
#include "common/error.h"

namespace kiln::trace {

inline constexpr bool kCallableAfterNull = PY_VERSION_HEX < 0x030D0000;  // 3.11/3.12: [NULL, callable, args]
inline constexpr bool kHasPrecall = PY_VERSION_HEX < 0x030C0000;

// Appends instructions, all at one source position.
struct Emitter {
  bytecode::CodeInstructions& out;
  bytecode::Positions pos;
  int emit(const char* name, int arg = 0) {
    int op = bytecode::opcodes().op(name);
    KILN_ASSERT(op >= 0) << "opcode " << name << " missing in this Python";
    bytecode::Instruction ins;
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
  /// Emits `op` (which replaces the top value by another) on the slot at `depth` (1 = top).
  void at_depth(int depth, const std::function<void()>& op) {
    if (depth > 1) emit("SWAP", depth);
    op();
    if (depth > 1) emit("SWAP", depth);
  }
  /// [iterator] -> [list of its items]
  void list_from_iterator() {
    emit("BUILD_LIST", 0);
    emit("SWAP", 2);
    emit("LIST_EXTEND", 1);
  }
  /// A forward jump taken when the top of the stack (a bool, popped) is False.
  int jump_forward_if_false() {
    static const char* name =
        bytecode::opcodes().op("POP_JUMP_FORWARD_IF_FALSE") >= 0 ? "POP_JUMP_FORWARD_IF_FALSE" : "POP_JUMP_IF_FALSE";
    return emit(name);
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

}  // namespace kiln::trace
