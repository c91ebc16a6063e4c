// Loads, stores and returns.
#include "common/error.h"
#include "trace/interpreter.h"

namespace kiln::trace {

using bytecode::Instruction;

namespace {
constexpr bool kNullAfterCallable = PY_VERSION_HEX >= 0x030D0000;  // 3.13: [callable, NULL]
}

void InstructionTranslator::op_push_null(const Instruction&) { push(make_null()); }
void InstructionTranslator::op_pop_top(const Instruction&) { pop(); }
void InstructionTranslator::op_copy(const Instruction& ins) { push(peek(ins.arg - 1)); }
void InstructionTranslator::op_swap(const Instruction& ins) { std::swap(peek(0), peek(ins.arg - 1)); }

void InstructionTranslator::op_load_fast(const Instruction& ins) {
  const VarPtr& v = locals_.at(ins.arg);
  if (!v) KILN_UNSUPPORTED() << "reading an unbound local (UnboundLocalError in eager)";
  push(v);
}

void InstructionTranslator::op_load_fast_and_clear(const Instruction& ins) {
  // 3.12 inlined comprehensions save the outer binding (maybe NULL) and restore it afterwards.
  VarPtr v = locals_.at(ins.arg);
  push(v ? v : make_null());
  locals_[ins.arg] = nullptr;
}

void InstructionTranslator::op_store_fast(const Instruction& ins) {
  VarPtr v = pop();
  locals_.at(ins.arg) = v->is(VarKind::kNull) ? nullptr : v;
}

void InstructionTranslator::op_delete_fast(const Instruction& ins) { locals_.at(ins.arg) = nullptr; }

namespace {
// 3.13's paired forms (LOAD_FAST_LOAD_FAST, ...) hold two 4-bit local indices in one argument.
std::pair<Instruction, Instruction> split_pair(const Instruction& ins) {
  Instruction first = ins, second = ins;
  first.arg = ins.arg >> 4;
  second.arg = ins.arg & 15;
  return {first, second};
}
}  // namespace

void InstructionTranslator::op_load_fast_load_fast(const Instruction& ins) {
  auto [a, b] = split_pair(ins);
  op_load_fast(a);
  op_load_fast(b);
}

void InstructionTranslator::op_store_fast_load_fast(const Instruction& ins) {
  auto [a, b] = split_pair(ins);
  op_store_fast(a);
  op_load_fast(b);
}

void InstructionTranslator::op_store_fast_store_fast(const Instruction& ins) {
  auto [a, b] = split_pair(ins);
  op_store_fast(a);
  op_store_fast(b);
}

void InstructionTranslator::op_load_const(const Instruction& ins) {
  push(make_const(PyTuple_GET_ITEM(code_->co_consts, ins.arg)));
}

void InstructionTranslator::op_load_global(const Instruction& ins) {
  PyObject* name = name_at(ins.arg >> 1);
  bool push_null = ins.arg & 1;
  if (push_null && !kNullAfterCallable) push(make_null());
  PyObject* value = PyDict_GetItemWithError(globals_, name);
  VarPtr v;
  if (value) {
    v = tracer_.wrap(value, tracer_.global_source(globals_, name));
  } else {
    if (PyErr_Occurred()) PyErr_Clear();
    value = PyDict_Check(builtins_) ? PyDict_GetItemWithError(builtins_, name) : nullptr;
    if (!value) KILN_UNSUPPORTED() << "name '" << PyUnicode_AsUTF8(name) << "' is not defined";
    // Builtins are taken as fixed (shadowing them through the module's globals is guarded above:
    // the name is absent from globals).
    v = make_const(value);
  }
  push(v);
  if (push_null && kNullAfterCallable) push(make_null());
}

void InstructionTranslator::op_load_attr(const Instruction& ins) {
  // 3.12+: bit 0 of the argument asks for the method form ([NULL, bound] in our model).
  bool method = PY_VERSION_HEX >= 0x030C0000 && (ins.arg & 1);
  PyObject* name = name_at(PY_VERSION_HEX >= 0x030C0000 ? ins.arg >> 1 : ins.arg);
  VarPtr obj = pop();
  VarPtr attr = tracer_.get_attr(obj, name);
  if (method && !kNullAfterCallable) push(make_null());
  push(attr);
  if (method && kNullAfterCallable) push(make_null());
}

void InstructionTranslator::op_load_method(const Instruction& ins) {
  VarPtr obj = pop();
  VarPtr attr = tracer_.get_attr(obj, name_at(ins.arg));
  push(make_null());
  push(attr);
}

void InstructionTranslator::op_load_deref(const Instruction& ins) {
  const VarPtr& v = locals_.at(ins.arg);
  if (!v) KILN_UNSUPPORTED() << "reading an empty cell (NameError in eager)";
  push(v);
}

void InstructionTranslator::op_store_deref(const Instruction& ins) {
  // Only cells local to this frame can be written: a free variable belongs to an enclosing frame
  // whose state the graph cannot update.
  int nlocalsplus = (int)PyTuple_GET_SIZE(code_->co_localsplusnames);
  int nfree = code_->co_nfreevars;
  if (ins.arg >= nlocalsplus - nfree) KILN_UNSUPPORTED() << "assigning a nonlocal variable";
  locals_.at(ins.arg) = pop();
}

void InstructionTranslator::op_return_value(const Instruction&) {
  returned_ = pop();
  done_ = true;
}

void InstructionTranslator::op_return_const(const Instruction& ins) {
  returned_ = make_const(PyTuple_GET_ITEM(code_->co_consts, ins.arg));
  done_ = true;
}

}  // namespace kiln::trace
