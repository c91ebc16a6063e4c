// try/except in traced code. An exception raised at trace time (TracedRaise: a `raise` of a constant exception,
// a query of process state or a builtin on constants that raised) goes where CPython sends it: the raising
// instruction's exception-table row names the handler, the depth the value stack is cut to, and whether the
// raising offset is pushed under the exception. The handler's bytecode then runs like any other: CHECK_EXC_MATCH
// compares classes known at trace time, so the branch taken is the one eager takes.
#include "common/error.h"
#include "trace/interpreter.h"

namespace kiln::trace {

using bytecode::Instruction;

bool InstructionTranslator::handler_covers_pc() const {
  for (const bytecode::ExceptionEntry& entry : instructions_.exception_table)
    if (entry.start <= pc_ && pc_ < entry.end) return true;
  return false;
}

bool InstructionTranslator::catch_raise(const TracedRaise& raised) {
  for (const bytecode::ExceptionEntry& entry : instructions_.exception_table) {
    if (pc_ < entry.start || pc_ >= entry.end) continue;
    // A with block's handler calls __exit__ with the exception, which the trace does not do: the raise is then
    // a graph break, and eager runs the block's exit.
    const auto& ops = bytecode::opcodes();
    const auto& code = instructions_.instructions;
    if (entry.target + 1 < (int)code.size() && ops.name(code[entry.target].opcode) == std::string("PUSH_EXC_INFO") &&
        ops.name(code[entry.target + 1].opcode) == std::string("WITH_EXCEPT_START"))
      return false;
    KILN_ASSERT((int)stack_.size() >= entry.depth) << "exception handler deeper than the stack at " << location();
    stack_.resize(entry.depth);
    if (entry.lasti) push(make_const_steal(PyLong_FromLong(instructions_.instructions[pc_].offset)));
    raised.exception()->caught = true;
    push(raised.exception());
    kwnames_ = nullptr;
    next_ = entry.target;
    return true;
  }
  return false;
}

void InstructionTranslator::op_push_exc_info(const Instruction&) {
  VarPtr exception = pop();
  auto& handled = tracer_.handled_exceptions_;
  push(handled.empty() ? make_const(Py_None) : handled.back());
  push(exception);
  handled.push_back(exception);
}

void InstructionTranslator::op_pop_except(const Instruction&) {
  pop();  // the exception handled before this one, which CPython makes current again
  auto& handled = tracer_.handled_exceptions_;
  if (!handled.empty()) handled.pop_back();
}

namespace {
// An exception Var: a constant or a record (exception_var, construct_exception) whose value is the instance.
bool is_exception(const VarPtr& v) {
  return (v->is(VarKind::kConst) || v->is(VarKind::kObject)) && v->value && PyExceptionInstance_Check(v->value);
}
}  // namespace

void InstructionTranslator::op_check_exc_match(const Instruction&) {
  VarPtr classes = pop();
  const VarPtr& exception = peek();
  if (!is_exception(exception) || !is_constant(classes))
    KILN_UNSUPPORTED() << "except clause matching a " << exception->describe();
  PyObject* against = to_python(classes);
  const int match = PyErr_GivenExceptionMatches(exception->value, against);
  Py_DECREF(against);
  push(make_const(match ? Py_True : Py_False));
}

void InstructionTranslator::raise_again(const VarPtr& exception, const char* context) {
  auto from_call = tracer_.exceptions_from_calls_.find(exception);
  if (from_call != tracer_.exceptions_from_calls_.end()) {
    tracer_.failed_override_ = from_call->second;
    KILN_UNSUPPORTED() << "raising again an exception that left an inlined call (eager's traceback holds that call's "
                          "frame): the graph breaks at the call";
  }
  throw TracedRaise(exception, context);
}

void InstructionTranslator::op_reraise(const Instruction&) {
  VarPtr exception = pop();
  if (!is_exception(exception)) KILN_UNSUPPORTED() << "re-raising a " << exception->describe();
  raise_again(exception, "re-raised");
}

void InstructionTranslator::op_raise_varargs(const Instruction& ins) {
  auto exception_of = [&](const VarPtr& v) -> VarPtr {
    if (is_exception(v)) return v;
    if (!v->is(VarKind::kConst) || !PyExceptionClass_Check(v->value))
      KILN_UNSUPPORTED() << "raising a " << v->describe();
    // `raise ValueError`: the class called with no arguments.
    return tracer_.call(v, {}, {});
  };
  switch (ins.arg) {
    case 0: {
      const auto& handled = tracer_.handled_exceptions_;
      if (handled.empty()) KILN_UNSUPPORTED() << "bare raise outside an except block of the traced code";
      raise_again(handled.back(), "re-raised");
    }
    case 1: raise_again(exception_of(pop()), "raised");
    default: {
      // `raise exc from cause`: the cause is set on the trace-time instance, for reads in a handler of the trace.
      // Uncaught, the frame breaks before this instruction and eager raises (and chains) it itself.
      VarPtr cause = pop();
      VarPtr exception = exception_of(pop());
      if (tracer_.exceptions_from_calls_.count(exception)) raise_again(exception, "raised");
      if (cause->is(VarKind::kConst) && cause->value == Py_None) {
        PyException_SetCause(exception->value, Py_NewRef(Py_None));
      } else {
        VarPtr made = exception_of(cause);
        PyException_SetCause(exception->value, Py_NewRef(made->value));
      }
      throw TracedRaise(exception, "raised");
    }
  }
}

}  // namespace kiln::trace
