#pragma once
// InstructionTranslator: symbolic execution of one code object's bytecode (the root frame's, or an
// inlined function's). Opcode handlers live in a table indexed by the running Python's opcode numbers
// (built by name from bytecode::opcodes()), grouped by family in interpreter_*.cpp files.
#include <Python.h>

#include <vector>

#include "bytecode/bytecode.h"
#include "trace/traced_raise.h"
#include "trace/tracer.h"
#include "trace/variables.h"

namespace kiln::trace {

/// "file:line in qualname" of the instruction the innermost running translator of this thread is at ("" when none
/// is): for messages that do not pass through an Unsupported error (why a size symbol was specialised).
std::string current_trace_location();

class InstructionTranslator {
 public:
  /// `locals` has co_nlocalsplus slots with the arguments bound; `freevars` the free variables' Vars.
  InstructionTranslator(Tracer& tracer, PyCodeObject* code, PyObject* globals, PyObject* builtins,
                        std::vector<VarPtr> locals, std::vector<VarPtr> freevars, PyObject* closure = nullptr);
  /// Runs to RETURN_VALUE and returns the returned Var.
  VarPtr run();
  /// A generator's frame: runs to its next YIELD_VALUE and returns the value yielded, or nullptr once the
  /// body has returned (the StopIteration value is dropped, as a for loop drops it; return_value() keeps it).
  VarPtr next_yield();
  /// What a finished generator's body returned (`x = yield from gen()` reads it); None before.
  VarPtr return_value() const { return return_value_; }
  /// A generator frame whose body has returned.
  bool finished() const { return finished_; }

  using Handler = void (InstructionTranslator::*)(const bytecode::Instruction&);

 private:
  friend struct HandlerTable;
  friend std::string current_trace_location();
  // stack
  void push(VarPtr v) { stack_.push_back(std::move(v)); }
  VarPtr pop();
  VarPtr& peek(int depth = 0);
  std::vector<VarPtr> pop_n(int n);
  std::string location() const;
  PyObject* name_at(int index) const;  ///< co_names[index] (borrowed)
  void jump(const bytecode::Instruction& ins) { next_ = ins.target; }

  // loads and stores (interpreter_loads.cpp)
  void op_nop(const bytecode::Instruction&) {}
  void op_push_null(const bytecode::Instruction&);
  void op_pop_top(const bytecode::Instruction&);
  void op_copy(const bytecode::Instruction&);
  void op_swap(const bytecode::Instruction&);
  void op_load_fast(const bytecode::Instruction&);
  void op_load_fast_and_clear(const bytecode::Instruction&);
  void op_store_fast(const bytecode::Instruction&);
  void op_delete_fast(const bytecode::Instruction&);
  void op_load_fast_load_fast(const bytecode::Instruction&);
  void op_store_fast_load_fast(const bytecode::Instruction&);
  void op_store_fast_store_fast(const bytecode::Instruction&);
  void op_load_const(const bytecode::Instruction&);
  void op_load_global(const bytecode::Instruction&);
  void op_store_attr(const bytecode::Instruction&);
  void op_delete_attr(const bytecode::Instruction&);
  void op_store_global(const bytecode::Instruction&);
  void op_load_attr(const bytecode::Instruction&);
  void op_load_method(const bytecode::Instruction&);
  void op_load_deref(const bytecode::Instruction&);
  void op_store_deref(const bytecode::Instruction&);
  void op_return_value(const bytecode::Instruction&);
  void op_return_const(const bytecode::Instruction&);
  void op_return_generator(const bytecode::Instruction&);
  void op_yield_value(const bytecode::Instruction&);
  // imports, closures and super() (interpreter_loads.cpp)
  void op_import_name(const bytecode::Instruction&);
  void op_import_from(const bytecode::Instruction&);
  void op_load_closure(const bytecode::Instruction&);
  void op_make_function(const bytecode::Instruction&);
  void op_load_super_attr(const bytecode::Instruction&);
  VarPtr zero_arg_super(VarPtr plain_super);  ///< `super` read in a method with a __class__ cell

  // operators and containers (interpreter_ops.cpp)
  void op_binary_op(const bytecode::Instruction&);
  void op_binary_subscr(const bytecode::Instruction&);
  void op_binary_slice(const bytecode::Instruction&);
  void op_unary(const bytecode::Instruction&);
  void op_compare_op(const bytecode::Instruction&);
  void op_is_op(const bytecode::Instruction&);
  void op_contains_op(const bytecode::Instruction&);
  bool module_contains_by_key(PyObject* module);  ///< ModuleDict/ParameterDict.__contains__ (kiln._tracing)
  void op_build_tuple(const bytecode::Instruction&);
  void op_build_list(const bytecode::Instruction&);
  void op_build_set(const bytecode::Instruction&);
  void op_set_add(const bytecode::Instruction&);
  void op_set_update(const bytecode::Instruction&);
  void op_build_map(const bytecode::Instruction&);
  void op_build_const_key_map(const bytecode::Instruction&);
  void op_build_slice(const bytecode::Instruction&);
  void op_build_string(const bytecode::Instruction&);
  void op_format_value(const bytecode::Instruction&);
  void op_list_append(const bytecode::Instruction&);
  void op_list_extend(const bytecode::Instruction&);
  void op_list_to_tuple(const bytecode::Instruction&);
  void op_dict_update(const bytecode::Instruction&);
  void op_map_add(const bytecode::Instruction&);
  void op_call_intrinsic_1(const bytecode::Instruction&);
  void op_unpack_sequence(const bytecode::Instruction&);
  void op_unpack_ex(const bytecode::Instruction&);
  void op_store_subscr(const bytecode::Instruction&);
  void op_store_slice(const bytecode::Instruction&);
  void op_delete_subscr(const bytecode::Instruction&);
  // container[key] = value, for STORE_SUBSCR and STORE_SLICE.
  void store_item(const VarPtr& container, const VarPtr& key, const VarPtr& value);

  // calls and control flow (interpreter_flow.cpp)
  void op_kw_names(const bytecode::Instruction&);
  void op_call(const bytecode::Instruction&);
  void op_call_kw(const bytecode::Instruction&);
  void op_call_function_ex(const bytecode::Instruction&);
  void op_pop_jump_if_true(const bytecode::Instruction&);
  void op_pop_jump_if_false(const bytecode::Instruction&);
  void op_pop_jump_if_none(const bytecode::Instruction&);
  void op_pop_jump_if_not_none(const bytecode::Instruction&);
  void op_jump_if_true_or_pop(const bytecode::Instruction&);
  void op_jump_if_false_or_pop(const bytecode::Instruction&);
  void op_jump(const bytecode::Instruction&);
  void op_to_bool(const bytecode::Instruction&);
  void op_get_iter(const bytecode::Instruction&);
  void op_for_iter(const bytecode::Instruction&);
  void op_end_for(const bytecode::Instruction&);
  // `yield from` (interpreter_flow.cpp): the delegate iterator advanced by SEND, one item per YIELD_VALUE.
  void op_get_yield_from_iter(const bytecode::Instruction&);
  void op_send(const bytecode::Instruction&);
  void op_end_send(const bytecode::Instruction&);
  // exceptions raised and caught in traced code (interpreter_except.cpp)
  void op_push_exc_info(const bytecode::Instruction&);
  void op_pop_except(const bytecode::Instruction&);
  void op_check_exc_match(const bytecode::Instruction&);
  void op_reraise(const bytecode::Instruction&);
  void op_raise_varargs(const bytecode::Instruction&);
  /// Sends `raised` to the exception-table handler of the instruction at pc_, as CPython does: the stack cut to
  /// the handler's depth, the exception pushed, the handler next. False when this frame has none there.
  bool catch_raise(const TracedRaise& raised);
  /// Raises `exception` (a Var the trace holds) again, or breaks at the call it left when it left an inlined frame.
  [[noreturn]] void raise_again(const VarPtr& exception, const char* context);
  /// True when an exception-table entry (a try, a with block) covers the instruction at pc_.
  bool handler_covers_pc() const;
  // with statements (grad_mode.cpp)
  void op_before_with(const bytecode::Instruction&);
  void call_with(VarPtr fn, std::vector<VarPtr> args, PyObject* kwnames);

  Tracer& tracer_;
  PyCodeObject* code_;
  PyObject* globals_;
  PyObject* builtins_;
  bytecode::CodeInstructions instructions_;
  std::vector<VarPtr> locals_;
  std::vector<VarPtr> stack_;
  PyObject* kwnames_ = nullptr;  // borrowed from co_consts (KW_NAMES)
  int pc_ = 0;
  int next_ = 0;
  VarPtr returned_;
  bool done_ = false;
  // Generator frames (next_yield).
  bool generator_ = false;
  /// Per free variable: its cell is a Var of this trace (a closure made in traced code) rather than a real
  /// cell from outside, whose assignment the graph could not make.
  std::vector<bool> trace_owned_free_;
  /// The root frame's closure (a tuple of cells, borrowed; nullptr in inlined frames): an assignment to one
  /// of its cells is made after the graph (Tracer::store_cell), through the cell the frame passes.
  PyObject* closure_ = nullptr;
  bool started_ = false;
  bool suspended_ = false;
  bool finished_ = false;
  VarPtr return_value_;
};

}  // namespace kiln::trace
