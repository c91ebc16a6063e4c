// The interpreter loop and the handler table; handlers by family are in interpreter_*.cpp.
#include "trace/interpreter.h"

#include <array>

#include "common/error.h"
#include "common/log.h"

namespace kiln::trace {

using bytecode::Instruction;
using H = InstructionTranslator::Handler;

// Opcode name -> handler. Names absent in the running Python are simply not installed, so one table
// serves 3.11, 3.12 and 3.13.
struct HandlerTable {
  std::array<H, 256> handlers{};
  HandlerTable() {
    using T = InstructionTranslator;
    const std::pair<const char*, H> entries[] = {
        {"NOP", &T::op_nop},
        {"RESUME", &T::op_nop},
        {"PRECALL", &T::op_nop},
        {"COPY_FREE_VARS", &T::op_nop},  // free variables are bound when the translator starts
        {"MAKE_CELL", &T::op_nop},       // cells are plain slots while tracing (no closures are created)
        {"PUSH_NULL", &T::op_push_null},
        {"POP_TOP", &T::op_pop_top},
        {"COPY", &T::op_copy},
        {"SWAP", &T::op_swap},
        {"LOAD_FAST", &T::op_load_fast},
        {"LOAD_FAST_CHECK", &T::op_load_fast},
        {"LOAD_FAST_AND_CLEAR", &T::op_load_fast_and_clear},
        {"STORE_FAST", &T::op_store_fast},
        {"STORE_FAST_MAYBE_NULL", &T::op_store_fast},
        {"DELETE_FAST", &T::op_delete_fast},
        {"LOAD_FAST_LOAD_FAST", &T::op_load_fast_load_fast},
        {"STORE_FAST_LOAD_FAST", &T::op_store_fast_load_fast},
        {"STORE_FAST_STORE_FAST", &T::op_store_fast_store_fast},
        {"LOAD_CONST", &T::op_load_const},
        {"LOAD_GLOBAL", &T::op_load_global},
        {"STORE_ATTR", &T::op_store_attr},
        {"DELETE_ATTR", &T::op_delete_attr},
        {"STORE_GLOBAL", &T::op_store_global},
        {"LOAD_ATTR", &T::op_load_attr},
        {"LOAD_METHOD", &T::op_load_method},
        {"LOAD_DEREF", &T::op_load_deref},
        {"STORE_DEREF", &T::op_store_deref},
        {"RETURN_VALUE", &T::op_return_value},
        {"RETURN_CONST", &T::op_return_const},
        {"BINARY_OP", &T::op_binary_op},
        {"BINARY_SUBSCR", &T::op_binary_subscr},
        {"BINARY_SLICE", &T::op_binary_slice},
        {"UNARY_NEGATIVE", &T::op_unary},
        {"UNARY_NOT", &T::op_unary},
        {"UNARY_INVERT", &T::op_unary},
        {"UNARY_POSITIVE", &T::op_unary},
        {"COMPARE_OP", &T::op_compare_op},
        {"IS_OP", &T::op_is_op},
        {"CONTAINS_OP", &T::op_contains_op},
        {"BUILD_TUPLE", &T::op_build_tuple},
        {"BUILD_LIST", &T::op_build_list},
        {"BUILD_SET", &T::op_build_set},
        {"SET_ADD", &T::op_set_add},
        {"SET_UPDATE", &T::op_set_update},
        {"BUILD_MAP", &T::op_build_map},
        {"BUILD_CONST_KEY_MAP", &T::op_build_const_key_map},
        {"BUILD_SLICE", &T::op_build_slice},
        {"BUILD_STRING", &T::op_build_string},
        {"FORMAT_VALUE", &T::op_format_value},
        {"FORMAT_SIMPLE", &T::op_format_value},
        {"LIST_APPEND", &T::op_list_append},
        {"LIST_EXTEND", &T::op_list_extend},
        {"LIST_TO_TUPLE", &T::op_list_to_tuple},
        {"DICT_UPDATE", &T::op_dict_update},
        {"DICT_MERGE", &T::op_dict_update},
        {"MAP_ADD", &T::op_map_add},
        {"CALL_INTRINSIC_1", &T::op_call_intrinsic_1},
        {"UNPACK_SEQUENCE", &T::op_unpack_sequence},
        {"UNPACK_EX", &T::op_unpack_ex},
        {"KW_NAMES", &T::op_kw_names},
        {"CALL", &T::op_call},
        {"CALL_KW", &T::op_call_kw},
        {"CALL_FUNCTION_EX", &T::op_call_function_ex},
        {"POP_JUMP_IF_TRUE", &T::op_pop_jump_if_true},
        {"POP_JUMP_IF_FALSE", &T::op_pop_jump_if_false},
        {"POP_JUMP_IF_NONE", &T::op_pop_jump_if_none},
        {"POP_JUMP_IF_NOT_NONE", &T::op_pop_jump_if_not_none},
        {"POP_JUMP_FORWARD_IF_TRUE", &T::op_pop_jump_if_true},
        {"POP_JUMP_FORWARD_IF_FALSE", &T::op_pop_jump_if_false},
        {"POP_JUMP_FORWARD_IF_NONE", &T::op_pop_jump_if_none},
        {"POP_JUMP_FORWARD_IF_NOT_NONE", &T::op_pop_jump_if_not_none},
        {"POP_JUMP_BACKWARD_IF_TRUE", &T::op_pop_jump_if_true},
        {"POP_JUMP_BACKWARD_IF_FALSE", &T::op_pop_jump_if_false},
        {"POP_JUMP_BACKWARD_IF_NONE", &T::op_pop_jump_if_none},
        {"POP_JUMP_BACKWARD_IF_NOT_NONE", &T::op_pop_jump_if_not_none},
        {"JUMP_IF_TRUE_OR_POP", &T::op_jump_if_true_or_pop},
        {"JUMP_IF_FALSE_OR_POP", &T::op_jump_if_false_or_pop},
        {"JUMP_FORWARD", &T::op_jump},
        {"JUMP_BACKWARD", &T::op_jump},
        {"JUMP_BACKWARD_NO_INTERRUPT", &T::op_jump},
        {"JUMP", &T::op_jump},
        {"TO_BOOL", &T::op_to_bool},
        {"GET_ITER", &T::op_get_iter},
        {"FOR_ITER", &T::op_for_iter},
        {"END_FOR", &T::op_end_for},
        {"GET_YIELD_FROM_ITER", &T::op_get_yield_from_iter},
        {"SEND", &T::op_send},
        {"END_SEND", &T::op_end_send},
        {"BEFORE_WITH", &T::op_before_with},
        {"IMPORT_NAME", &T::op_import_name},
        {"IMPORT_FROM", &T::op_import_from},
        {"LOAD_CLOSURE", &T::op_load_closure},
        {"MAKE_FUNCTION", &T::op_make_function},
        {"RETURN_GENERATOR", &T::op_return_generator},
        {"YIELD_VALUE", &T::op_yield_value},
        {"LOAD_SUPER_ATTR", &T::op_load_super_attr},
        {"STORE_SUBSCR", &T::op_store_subscr},
        {"STORE_SLICE", &T::op_store_slice},
        {"DELETE_SUBSCR", &T::op_delete_subscr},
        {"PUSH_EXC_INFO", &T::op_push_exc_info},
        {"POP_EXCEPT", &T::op_pop_except},
        {"CHECK_EXC_MATCH", &T::op_check_exc_match},
        {"RERAISE", &T::op_reraise},
        {"RAISE_VARARGS", &T::op_raise_varargs},
    };
    const auto& ops = bytecode::opcodes();
    for (const auto& [name, handler] : entries) {
      int op = ops.op(name);
      if (op >= 0) handlers[op] = handler;
    }
  }
};

namespace {
const HandlerTable& handler_table() {
  static HandlerTable table;  // built under the GIL on the first trace
  return table;
}
}  // namespace

InstructionTranslator::InstructionTranslator(Tracer& tracer, PyCodeObject* code, PyObject* globals,
                                             PyObject* builtins, std::vector<VarPtr> locals,
                                             std::vector<VarPtr> freevars, PyObject* closure)
    : tracer_(tracer), code_(code), globals_(globals), builtins_(builtins), locals_(std::move(locals)), closure_(closure) {
  KILN_CHECK(!(code->co_flags & (CO_COROUTINE | CO_ASYNC_GENERATOR | CO_ITERABLE_COROUTINE)))
      << "coroutines are not traced";
  generator_ = (code->co_flags & CO_GENERATOR) != 0;
  instructions_ = bytecode::decode(code);
  int nlocalsplus = (int)PyTuple_GET_SIZE(code->co_localsplusnames);
  locals_.resize(nlocalsplus);
  // Free variables occupy the last slots of localsplus.
  int first_free = nlocalsplus - (int)freevars.size();
  for (size_t j = 0; j < freevars.size(); ++j) {
    trace_owned_free_.push_back(freevars[j] && freevars[j]->is(VarKind::kCell));
    locals_[first_free + j] = freevars[j];
  }
}

VarPtr InstructionTranslator::next_yield() {
  KILN_ASSERT(generator_) << "next_yield on a frame that is not a generator's";
  if (finished_) return nullptr;
  if (started_) push(make_const(Py_None));  // the value of the paused yield expression: next() sends None
  started_ = true;
  suspended_ = done_ = false;
  VarPtr value = run();
  if (suspended_) return value;
  finished_ = true;
  return_value_ = value;
  return nullptr;
}

void InstructionTranslator::op_return_generator(const Instruction&) {
  // The generator's first resumption continues here with the value sent (None), which POP_TOP drops.
  KILN_ASSERT(generator_) << "RETURN_GENERATOR outside a generator";
  push(make_const(Py_None));
}

void InstructionTranslator::op_yield_value(const Instruction&) {
  if (!generator_) KILN_UNSUPPORTED() << "yield outside a generator frame";
  returned_ = pop();
  suspended_ = done_ = true;
}

VarPtr InstructionTranslator::pop() {
  KILN_ASSERT(!stack_.empty()) << "symbolic stack underflow at " << location();
  VarPtr v = std::move(stack_.back());
  stack_.pop_back();
  return v;
}

VarPtr& InstructionTranslator::peek(int depth) {
  KILN_ASSERT((int)stack_.size() > depth) << "symbolic stack underflow at " << location();
  return stack_[stack_.size() - 1 - depth];
}

std::vector<VarPtr> InstructionTranslator::pop_n(int n) {
  KILN_ASSERT((int)stack_.size() >= n) << "symbolic stack underflow at " << location();
  std::vector<VarPtr> out(stack_.end() - n, stack_.end());
  stack_.resize(stack_.size() - n);
  return out;
}

PyObject* InstructionTranslator::name_at(int index) const { return PyTuple_GET_ITEM(code_->co_names, index); }

namespace {
thread_local const InstructionTranslator* g_running = nullptr;
}  // namespace

std::string current_trace_location() { return g_running ? g_running->location() : std::string(); }

std::string InstructionTranslator::location() const {
  int line = pc_ < (int)instructions_.instructions.size() ? instructions_.instructions[pc_].pos.line : -1;
  return std::string(PyUnicode_AsUTF8(code_->co_filename)) + ":" + std::to_string(line) + " in " +
         PyUnicode_AsUTF8(code_->co_qualname);
}

VarPtr InstructionTranslator::run() {
  const auto& table = handler_table();
  const auto& ops = bytecode::opcodes();
  const auto& instrs = instructions_.instructions;
  int steps = 0;
  struct Running {  // (inlined calls nest translators: the innermost is the one to name)
    const InstructionTranslator* saved;
    explicit Running(const InstructionTranslator* t) : saved(g_running) { g_running = t; }
    ~Running() { g_running = saved; }
  } running(this);
  try {
    while (!done_) {
      KILN_CHECK(pc_ >= 0 && pc_ < (int)instrs.size()) << "fell off the end of the bytecode";
      // Unrolled loops are bounded so a runaway trace ends in a fallback, not a hang.
      if (++steps > 200000) KILN_UNSUPPORTED() << "trace too long (a loop unrolled past 200000 instructions)";
      if (tracer_.depth() == 0 && steps == tracer_.break_step_) {
        // A graph break planned by a previous trace of this frame: stop before the instruction that
        // failed there, with everything before it traced (trace.cpp's finish builds the graph).
        tracer_.broke_ = true;
        tracer_.break_state_ = BreakState{pc_, stack_, locals_, kwnames_, !tracer_.handled_exceptions_.empty()};
        return nullptr;
      }
      if (tracer_.depth() == 0) {
        tracer_.root_step_ = steps;
        tracer_.root_pc_ = pc_;
      }
      const Instruction& ins = instrs[pc_];
      next_ = pc_ + 1;
      H handler = table.handlers[ins.opcode];
      if (!handler) KILN_UNSUPPORTED() << "bytecode " << ops.name(ins.opcode) << " is not traced yet";
      try {
        (this->*handler)(ins);
      } catch (const TracedRaise& raised) {
        // Eager raises here: this frame's own handler takes it. An inlined function's frame with no handler here
        // (no with block whose __exit__ would run) unwinds as CPython's does, and the handlers of the inlined frames
        // that called it may take it (a helper's `except IndexError`, a Sequence's __iter__ ending at its IndexError):
        // a caught exception never leaves the trace (Var::caught), so the traceback it would carry (the inlined
        // frames) is never seen; raising it again breaks at the call it left (raise_again). The root frame's own
        // handlers do not take it: the root would hold it in its locals, live at later breaks that cannot rebuild
        // it. Nor does a generator's frame pass it on (it would have to finish). There the root breaks at its
        // instruction that led here, and eager raises it for real.
        const bool from_call = tracer_.exceptions_from_calls_.count(raised.exception()) > 0;
        if ((tracer_.depth() > 0 || !from_call) && catch_raise(raised)) {
          // taken by this frame's handler
        } else {
          if (tracer_.depth() > 0 && !generator_ && !handler_covers_pc()) {
            tracer_.exceptions_from_calls_.emplace(raised.exception(), std::pair{tracer_.root_step_, tracer_.root_pc_});
            throw;
          }
          KILN_UNSUPPORTED() << raised.describe()
                             << (tracer_.depth() > 0 || from_call ? ", raised out of an inlined call" : ", not caught in the traced frame");
        }
      }
      pc_ = next_;
    }
  } catch (const Error& e) {
    if (tracer_.depth() == 0 && e.kind() == ErrorKind::Unsupported) {
      const auto [step, pc] = tracer_.failed_override_;
      tracer_.failed_step_ = step >= 0 ? step : steps;
      tracer_.failed_pc_ = step >= 0 ? pc : pc_;
    }
    std::string msg = e.what();
    if (e.kind() == ErrorKind::Unsupported && msg.find(" [at ") == std::string::npos)
      throw Error(ErrorKind::Unsupported, msg + " [at " + location() + "]");
    throw;
  }
  return returned_;
}

}  // namespace kiln::trace
