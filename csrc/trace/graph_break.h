#pragma once
// Graph breaks in the root frame. When the tracer meets an instruction it cannot capture, the frame is
// split there: the graph traced so far is compiled, and the frame's transformed code becomes
//
//   [prologue] values = program(args...)        # the graph so far + the live values it rebuilds
//              store the live locals, rebuild the stack from `values`
//              <the original instruction>       # run by CPython: a call, a raise, a tensor-valued branch
//              return resume(stack..., locals...)   # one resume function per successor
//
// A resume function is a generated code object that pushes its stack arguments back and jumps into a
// copy of the original bytecode right after the break; the frame hook intercepts and traces it like any
// other frame. Inside grad-mode `with` blocks the break instruction is covered by a handler that restores
// the mode eager would leave after the exception and re-raises. Breaks are refused (the frame then runs
// eagerly) where this rewrite could change what the program does: inside a try block or the with block of
// any other context manager, inside a loop, in frames with cells (variables captured by nested
// functions), or with values that cannot be rebuilt (iterators).
#include <Python.h>

#include <string>
#include <vector>

#include "bytecode/bytecode.h"
#include "trace/tracer.h"

namespace kiln::trace {

/// Where execution continues after the break instruction: instruction `target` of the original code,
/// with the stack below the consumed slots plus `pushed` new values on top.
struct BreakSuccessor {
  int target = -1;
  int pushed = 0;
};

struct BreakPlan {
  int pc = -1;                              ///< the break instruction (index in the decoded original)
  int consumed = 0;                         ///< stack slots it takes (NULLs included)
  std::vector<BreakSuccessor> successors;   ///< fall-through first, then the jump target; none after a raise
  std::vector<bool> stack_null;             ///< the stack at the break, bottom first: true = a NULL slot
  std::vector<int> live_locals;             ///< localsplus indices of the bound locals (restored, passed on)
  int kwnames_const = -1;                   ///< co_consts index of a pending KW_NAMES tuple
  /// Inside grad-mode `with` blocks: the mode an exception from the break instruction must leave behind
  /// (the mode before the outermost block, as eager's __exit__ calls restore it); -1 outside any block.
  /// The resume functions need nothing extra: the graph leaves the block's mode set, and the pending
  /// __exit__ methods travel on the stack into a copy of the original code with its exception table.
  int restore_grad_mode = -1;
  std::string why_not;                      ///< non-empty: no break possible here (the frame runs eagerly)
  std::string instruction;                  ///< opcode name of the break instruction
};

/// Decides whether and how the root frame of `code` can break before `state.pc`.
BreakPlan plan_break(PyCodeObject* code, const bytecode::CodeInstructions& ci, const BreakState& state);

/// The tuple of live values the program returns at a break, in the order the break code consumes them:
/// the live locals (live_locals order), then the non-NULL stack slots from the top down.
VarPtr break_values(const BreakPlan& plan, const BreakState& state);

/// The transformed code for a break (see the file comment); `resume_functions[i]` continues successor i:
/// a function, or for frames with free variables its code (the function is made at run time around the
/// frame's own closure cells).
/// New reference; throws kiln::Error.
PyObject* make_break_code(PyCodeObject* original, const bytecode::CodeInstructions& ci, const BreakPlan& plan,
                          PyObject* program, const std::vector<PyObject*>& resume_functions);

/// The resume code for `successor`: arguments are the non-NULL stack slots (bottom first) then the live
/// locals. Cached per original code, target and layout, so repeated compiles reuse one code object (and
/// its cache entries). Borrowed reference, kept alive by the cache; throws kiln::Error.
PyObject* resume_code(PyCodeObject* original, const bytecode::CodeInstructions& ci, const BreakPlan& plan,
                      const BreakSuccessor& successor);

}  // namespace kiln::trace
