// Calls and control flow. Branches are followed statically: their conditions must be known at trace
// time (constants, shapes, module flags), and those values are guarded.
#include "common/error.h"
#include "trace/interpreter.h"

namespace kiln::trace {

using bytecode::Instruction;

void InstructionTranslator::op_kw_names(const Instruction& ins) { kwnames_ = PyTuple_GET_ITEM(code_->co_consts, ins.arg); }

void InstructionTranslator::call_with(VarPtr fn, std::vector<VarPtr> args, PyObject* kwnames) {
  KwArgs kwargs;
  if (kwnames) {
    Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
    size_t first = args.size() - nkw;
    for (Py_ssize_t i = 0; i < nkw; ++i) kwargs.emplace_back(PyTuple_GET_ITEM(kwnames, i), args[first + i]);
    args.resize(first);
  }
  push(tracer_.call(fn, std::move(args), std::move(kwargs)));
}

void InstructionTranslator::op_call(const Instruction& ins) {
  std::vector<VarPtr> args = pop_n(ins.arg);
  PyObject* kwnames = kwnames_;
  kwnames_ = nullptr;
  VarPtr b = pop();
  VarPtr a = pop();
  VarPtr fn;
  if (PY_VERSION_HEX >= 0x030D0000) {
    // 3.13: [callable, self_or_NULL, args...]
    fn = a;
    if (!b->is(VarKind::kNull)) args.insert(args.begin(), b);
  } else {
    // 3.11/3.12: [NULL, callable, args...] or [method, self, args...]
    if (a->is(VarKind::kNull)) {
      fn = b;
    } else {
      fn = a;
      args.insert(args.begin(), b);
    }
  }
  call_with(std::move(fn), std::move(args), kwnames);
}

void InstructionTranslator::op_call_kw(const Instruction& ins) {
  VarPtr names = pop();
  kwnames_ = names->value;
  Instruction call = ins;
  op_call(call);
}

void InstructionTranslator::op_call_function_ex(const Instruction& ins) {
  VarPtr kwargs = (ins.arg & 1) ? pop() : nullptr;
  VarPtr args = pop();
  VarPtr fn = pop();
  if (PY_VERSION_HEX >= 0x030D0000) {
    if (!stack_.empty() && peek()->is(VarKind::kNull)) pop();
  } else if (!stack_.empty() && peek()->is(VarKind::kNull)) {
    pop();
  }
  std::vector<VarPtr> positional = tracer_.iterate(args);
  KwArgs kw;
  if (kwargs) {
    if (!kwargs->is(VarKind::kDict)) KILN_UNSUPPORTED() << "**kwargs of a " << kwargs->describe();
    for (size_t i = 0; i < kwargs->keys.size(); ++i) kw.emplace_back(kwargs->keys[i], kwargs->items[i]);
  }
  push(tracer_.call(fn, std::move(positional), std::move(kw)));
}

void InstructionTranslator::op_pop_jump_if_true(const Instruction& ins) {
  if (tracer_.truthy(pop())) jump(ins);
}

void InstructionTranslator::op_pop_jump_if_false(const Instruction& ins) {
  if (!tracer_.truthy(pop())) jump(ins);
}

namespace {
bool is_none(const VarPtr& v) { return v->is(VarKind::kConst) && v->value == Py_None; }
}  // namespace

void InstructionTranslator::op_pop_jump_if_none(const Instruction& ins) {
  if (is_none(pop())) jump(ins);
}

void InstructionTranslator::op_pop_jump_if_not_none(const Instruction& ins) {
  if (!is_none(pop())) jump(ins);
}

void InstructionTranslator::op_jump_if_true_or_pop(const Instruction& ins) {
  if (tracer_.truthy(peek()))
    jump(ins);
  else
    pop();
}

void InstructionTranslator::op_jump_if_false_or_pop(const Instruction& ins) {
  if (!tracer_.truthy(peek()))
    jump(ins);
  else
    pop();
}

void InstructionTranslator::op_jump(const Instruction& ins) { jump(ins); }

void InstructionTranslator::op_to_bool(const Instruction&) {
  VarPtr v = pop();
  push(make_const(tracer_.truthy(v) ? Py_True : Py_False));
}

void InstructionTranslator::op_get_iter(const Instruction&) {
  VarPtr v = pop();
  if (v->is(VarKind::kUserObject)) {
    // Its class's __iter__: a generator it returns is advanced by FOR_ITER, interleaved with the loop as in eager.
    VarPtr dunder_iter = tracer_.python_special_method(v, "__iter__");
    if (!dunder_iter) KILN_UNSUPPORTED() << "iterating a " << v->describe() << " (its class has no Python __iter__)";
    v = tracer_.call(dunder_iter, {}, {});
  }
  if (v->is(VarKind::kGenerator)) {  // its own iterator, advanced item by item by FOR_ITER
    push(v);
    return;
  }
  auto it = make_sequence(VarKind::kIterator, tracer_.iterate(v));
  push(it);
}

void InstructionTranslator::op_for_iter(const Instruction& ins) {
  VarPtr& it = peek();
  if (it->is(VarKind::kGenerator)) {
    VarPtr gen = it;  // `it` refers into the stack, which the generator's body does not touch
    if (VarPtr item = tracer_.generator_next(gen)) {
      push(std::move(item));
      return;
    }
  } else if (!it->is(VarKind::kIterator)) {
    KILN_UNSUPPORTED() << "for-loop over a " << it->describe();
  } else if (it->position < it->items.size()) {
    push(it->items[it->position++]);
    return;
  }
  pop();
  // Exhausted: 3.11 jumps to the target; 3.12 skips the END_FOR there; 3.13 skips END_FOR and POP_TOP.
  next_ = ins.target + (PY_VERSION_HEX >= 0x030D0000 ? 2 : PY_VERSION_HEX >= 0x030C0000 ? 1 : 0);
}

void InstructionTranslator::op_get_yield_from_iter(const Instruction& ins) {
  if (!generator_) KILN_UNSUPPORTED() << "yield from outside a generator frame";
  op_get_iter(ins);  // a generator stays itself; anything else iterates as a for loop would
}

void InstructionTranslator::op_send(const Instruction& ins) {
  // Stack: the delegate, the value sent. The trace only ever resumes a generator with None (next(), a for loop), so
  // the delegate is advanced as next() advances it; its end jumps to the target with its return value.
  VarPtr sent = pop();
  if (!sent->is(VarKind::kConst) || sent->value != Py_None)
    KILN_UNSUPPORTED() << "send() of a value into a delegated generator";
  VarPtr delegate = peek();
  VarPtr item;
  VarPtr result = make_const(Py_None);
  if (delegate->is(VarKind::kGenerator)) {
    item = tracer_.generator_next(delegate);
    if (!item && delegate->frame->return_value()) result = delegate->frame->return_value();
  } else if (delegate->is(VarKind::kIterator)) {
    if (delegate->position < delegate->items.size()) item = delegate->items[delegate->position++];
  } else {
    KILN_UNSUPPORTED() << "yield from a " << delegate->describe();
  }
  if (item) {
    push(std::move(item));  // YIELD_VALUE hands it on
    return;
  }
  // 3.11 replaces the delegate with the result; 3.12 keeps it under the result for END_SEND at the target.
  if (PY_VERSION_HEX < 0x030C0000) pop();
  push(std::move(result));
  jump(ins);
}

void InstructionTranslator::op_end_send(const Instruction&) {
  VarPtr value = pop();
  pop();  // the delegate
  push(std::move(value));
}

void InstructionTranslator::op_end_for(const Instruction&) {
  // Reached only by fall-through, which compiled code never does; mirror CPython (pops 2 in 3.12).
  pop();
  if (PY_VERSION_HEX < 0x030D0000) pop();
}

}  // namespace kiln::trace
