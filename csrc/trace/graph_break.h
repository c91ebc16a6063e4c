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
// other frame. The copy carries the original exception table, so the `with` blocks and `try` bodies the
// break is inside go on in the resume function exactly as in the original.
//
// Breaks inside blocks and loops:
//  - inside grad-mode `with` blocks only, the break instruction is covered by a handler that restores the
//    mode eager would leave after an exception and re-raises;
//  - inside any other block (a `try` body, a user context manager's `with` block), the break code carries a
//    copy of the original body too, and an exception entry that sends an exception from the break
//    instruction to the original handler in that copy (run by CPython: __exit__ called as the original
//    calls it, the except clause, the finally clause), with the stack exactly as the original has it;
//  - a `with` statement on a context manager the tracer cannot enter is itself the break: BEFORE_WITH runs
//    in Python and the resume function starts inside the block, with __exit__ on its stack;
//  - inside a loop, the loop's iterator travels as a list of the items it has left (the resume function's
//    prologue makes it an iterator again), so the rest of this iteration and the next ones are traced by the
//    resume function, which breaks again once per iteration. Past a nesting depth (each iteration is one
//    more nested call) the loop goes on eagerly in the copy of the body instead.
// A resume function made for a resume function's frame is made from the first original code, so a loop
// has one resume code object per break site, whose cache entries later iterations and calls reuse.
// In a frame with cells (variables captured by nested functions), the resume functions take the frame's
// cells as their free variables, and functions made in the trace around them are made again by the break
// code. Breaks are refused (the frame then runs eagerly) on Python 3.13 in frames with cells, with values
// that cannot be rebuilt, or where the stack holds a call in progress below the
// break inside a block or loop (its NULL slot cannot be restored exactly).
#include <Python.h>

#include <string>
#include <unordered_set>
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
  /// Index in the exception table of the entry covering the break instruction when the break is inside a
  /// block other than grad-mode ones (a try body, a user context manager): the break code sends an exception
  /// to that handler in its copy of the original body. -1 otherwise.
  int handler_entry = -1;
  bool in_loop = false;                     ///< the break instruction is inside a for/while loop
  std::vector<bool> stack_iterator;         ///< per stack slot: a loop iterator (travels as a list of its items)
  /// Frames with cells (variables captured by nested functions): the cells bound at the break, stored into
  /// the frame's own cells by the break code (their values follow the live locals in break_values); the
  /// argument cells unbound at the break (emptied); and the functions with closures made in the trace that
  /// locals hold, made again by the break code around the frame's cells (not passed through the program).
  /// The resume functions get the cells as free variables, so closures made before and after the break
  /// share them as in eager.
  std::vector<int> cell_values;
  std::vector<int> cells_deleted;
  struct Closure {
    int slot = -1;               ///< localsplus index that holds it
    bool in_cell = false;        ///< the slot is a cell (STORE_DEREF)
    PyObject* function = nullptr;  ///< the trace's stand-in function (its code and defaults), borrowed
    std::vector<int> cells;      ///< localsplus index of each closure cell, co_freevars order
    int same_as = -1;            ///< index of an earlier entry holding the same function (one object)
  };
  std::vector<Closure> closures;
  bool function_local(int slot) const {
    for (const Closure& c : closures)
      if (c.slot == slot && !c.in_cell) return true;
    return false;
  }
  std::string why_not;                      ///< non-empty: no break possible here (the frame runs eagerly)
  std::string instruction;                  ///< opcode name of the break instruction
};

/// Decides whether and how the root frame of `code` can break before `state.pc`.
BreakPlan plan_break(PyCodeObject* code, const bytecode::CodeInstructions& ci, const BreakState& state);

/// Why a value cannot be rebuilt by the compiled frame after its graph ("" when it can): at a break (a live
/// value), or as the value of a store replayed after the graph. `seen` stops at containers already visited
/// (the output keeps a container reachable twice as one object, see OutputSpec::kRepeat).
std::string unrebuildable(const VarPtr& v, std::unordered_set<const Var*>& seen);

/// True when `v` is the bound __exit__ of a torch.autocast manager made in traced code (a `with` block the
/// trace entered, which the compiled frame enters for real at a break inside it).
bool is_traced_autocast_exit(const VarPtr& v);

/// The tuple of live values the program returns at a break, in the order the break code consumes them:
/// the live locals (live_locals order), then the non-NULL stack slots from the top down (a loop iterator
/// as the list of the items it has left).
VarPtr break_values(const BreakPlan& plan, const BreakState& state);

/// The transformed code for a break (see the file comment); `resume_functions[i]` continues successor i:
/// a function, or for frames with free variables its code (the function is made at run time around the
/// frame's own closure cells).
/// New reference; throws kiln::Error.
PyObject* make_break_code(PyCodeObject* original, const bytecode::CodeInstructions& ci, const BreakPlan& plan,
                          PyObject* program, const std::vector<PyObject*>& resume_functions);

/// The resume code for `successor`: arguments are the non-NULL stack slots (bottom first) then the live
/// locals. Cached per original code, target and layout, so repeated compiles reuse one code object (and
/// its cache entries). When `original` is itself a resume code, the new one is made from the code it was
/// made from (same break site, same code object on every iteration of a loop). Borrowed reference, kept
/// alive by the cache; throws kiln::Error.
PyObject* resume_code(PyCodeObject* original, const bytecode::CodeInstructions& ci, const BreakPlan& plan,
                      const BreakSuccessor& successor);

/// True when the resume functions of `code` close over its cells or free variables: the break code makes
/// them at run time around the frame's own cells, and `resume_functions` are their codes.
bool resume_needs_closure(PyCodeObject* code);

/// True when `code` is a resume code (made by resume_code).
bool is_resume_code(PyObject* code);

/// True when `code` is a resume code whose break site is inside a loop: its cache entries are one per
/// iteration rather than recompiles (compile_frame.cpp counts them against module_instance_limit).
bool is_loop_resume_code(PyObject* code);

/// For a resume code: the index its local `local` has in the code it was made from (-1 for a stack
/// argument); for any other code, `local` itself.
int original_local(PyCodeObject* code, int local);

}  // namespace kiln::trace
