// Operators, containers and unpacking.
#include "common/error.h"
#include "trace/interpreter.h"

namespace kiln::trace {

using bytecode::Instruction;

namespace {
PyObject* operator_fn(const char* name) {
  static PyObject* operator_module = PyImport_ImportModule("operator");
  PyObject* f = PyObject_GetAttrString(operator_module, name);
  KILN_ASSERT(f) << "operator." << name;
  Py_DECREF(f);  // kept alive by the module
  return f;
}

PyObject* table_entry(Tracer& tracer, const char* table, int index) {
  PyObject* list = tracer.helper(table);
  PyObject* fn = PyList_GetItem(list, index);
  if (!fn) {
    PyErr_Clear();
    KILN_UNSUPPORTED() << "operator #" << index << " of " << table;
  }
  return fn;
}
}  // namespace

void InstructionTranslator::op_binary_op(const Instruction& ins) {
  VarPtr b = pop();
  VarPtr a = pop();
  push(tracer_.binary(table_entry(tracer_, "BINARY_OPS", ins.arg), a, b));
}

void InstructionTranslator::op_binary_subscr(const Instruction&) {
  VarPtr index = pop();
  VarPtr obj = pop();
  if (obj->by_type) {
    if (VarPtr getitem = tracer_.python_special_method(obj, "__getitem__")) {
      push(tracer_.call(getitem, {index}, {}));
      return;
    }
  }
  push(tracer_.subscript(obj, index));
}

void InstructionTranslator::op_binary_slice(const Instruction&) {
  VarPtr stop = pop();
  VarPtr start = pop();
  VarPtr obj = pop();
  VarPtr slice = make_sequence(VarKind::kSlice, {start, stop, make_const(Py_None)});
  if (is_constant(slice) && !holds_symbolic_int(slice)) slice = make_const_steal(to_python(slice));
  push(tracer_.subscript(obj, slice));
}

void InstructionTranslator::op_unary(const Instruction& ins) {
  std::string name = bytecode::opcodes().name(ins.opcode);
  VarPtr v = pop();
  if (name == "UNARY_NOT") {
    push(make_const(tracer_.truthy(v) ? Py_False : Py_True));
    return;
  }
  const char* fn = name == "UNARY_NEGATIVE" ? "neg" : name == "UNARY_INVERT" ? "invert" : "pos";
  PyObject* op = operator_fn(fn);
  if (v->is(VarKind::kTensor)) {
    push(tracer_.call_recorded(op, {v}, {}));
  } else if (v->is(VarKind::kSymInt) && name == "UNARY_NEGATIVE") {
    push(tracer_.symbolic()->negate(v));
  } else if (is_constant(v)) {
    PyObject* x = to_python(v);
    PyObject* r = x ? PyObject_CallOneArg(op, x) : nullptr;
    Py_XDECREF(x);
    if (!r) {
      PyErr_Clear();
      KILN_UNSUPPORTED() << "unary " << fn << " raised";
    }
    push(make_const_steal(r));
  } else {
    KILN_UNSUPPORTED() << "unary " << fn << " of a " << v->describe();
  }
}

void InstructionTranslator::op_compare_op(const Instruction& ins) {
  int shift = PY_VERSION_HEX >= 0x030D0000 ? 5 : PY_VERSION_HEX >= 0x030C0000 ? 4 : 0;
  VarPtr b = pop();
  VarPtr a = pop();
  push(tracer_.binary(table_entry(tracer_, "COMPARE_OPS", ins.arg >> shift), a, b));
}

void InstructionTranslator::op_is_op(const Instruction& ins) {
  VarPtr b = pop();
  VarPtr a = pop();
  auto pinned_singleton = [](const VarPtr& v) {
    return v->is(VarKind::kConst) && (v->value == Py_None || PyBool_Check(v->value));
  };
  // Objects guarded by type only may be other instances next call: identity with anything but
  // None/True/False is not known at trace time, unless the two types differ (their guards keep them apart: an
  // annotation `int | None` is never typing.Generic, whatever instance a later call brings).
  auto other_types = [](const VarPtr& x, const VarPtr& y) {
    return x->is(VarKind::kConst) && y->is(VarKind::kConst) && x->value && y->value &&
           Py_TYPE(x->value) != Py_TYPE(y->value);
  };
  if (((a->by_type && !pinned_singleton(b)) || (b->by_type && !pinned_singleton(a))) && !other_types(a, b))
    KILN_UNSUPPORTED() << "'is' between objects whose identity is not guarded";
  // Two containers read from the frame through different paths (a local and a global, as copy.py's
  // `y is not _nil`) may be one object: their identity is not guarded either.
  auto read_container = [](const VarPtr& v) {
    return v->source && (v->is(VarKind::kList) || v->is(VarKind::kDict) || v->is(VarKind::kTuple) || v->is(VarKind::kSet));
  };
  if (a != b && read_container(a) && read_container(b))
    KILN_UNSUPPORTED() << "'is' between two containers read from the frame (aliasing is not guarded)";
  bool same;
  if (a == b) {
    same = true;
  } else if (a->is(VarKind::kConst) && b->is(VarKind::kConst)) {
    same = a->value == b->value;
  } else if (a->is(VarKind::kConst) || b->is(VarKind::kConst)) {
    // A symbolic value (tensor, container, module) is never the same object as a constant like None.
    const VarPtr& c = a->is(VarKind::kConst) ? a : b;
    const VarPtr& other = a->is(VarKind::kConst) ? b : a;
    same = other->is(VarKind::kModule) && other->value == c->value;
  } else if (a->is(VarKind::kModule) && b->is(VarKind::kModule)) {
    same = a->value == b->value;
  } else {
    same = false;
  }
  bool result = ins.arg ? !same : same;
  push(make_const(result ? Py_True : Py_False));
}

bool InstructionTranslator::module_contains_by_key(PyObject* module) {
  PyObject* r = PyObject_CallOneArg(tracer_.helper("contains_by_key"), module);
  if (!r) rethrow_python("inspecting a module's __contains__");
  Py_DECREF(r);
  return r == Py_True;
}

void InstructionTranslator::op_contains_op(const Instruction& ins) {
  VarPtr container = pop();
  VarPtr item = pop();
  if (container->by_type) {
    if (VarPtr contains = tracer_.python_special_method(container, "__contains__")) {
      bool found = tracer_.truthy(tracer_.call(contains, {item}, {}));
      push(make_const((ins.arg ? !found : found) ? Py_True : Py_False));
      return;
    }
    // A dict subclass from the frame: its keys, guarded.
    if (!PyDict_Check(container->value) || !container->source)
      KILN_UNSUPPORTED() << "'in' on a " << Py_TYPE(container->value)->tp_name << " object (its items are not guarded)";
    container = tracer_.snapshot_dict(container);
  }
  bool found = false;
  if (container->is(VarKind::kSet)) {
    found = tracer_.set_contains(container, item);
  } else if (container->is(VarKind::kDict) && item->is(VarKind::kConst)) {
    for (PyObject* k : container->keys) found = found || PyObject_RichCompareBool(k, item->value, Py_EQ) == 1;
  } else if (item->is(VarKind::kConst) && (container->is(VarKind::kObject) ||
             (container->is(VarKind::kModule) && !item->by_type && module_contains_by_key(container->value)))) {
    // `"loss" in output` of a ModelOutput: its keys, on the trace-time instance (a read, like out[key]).
    // `"b" in self.heads` of a ModuleDict or ParameterDict: its keys, guarded as iterating it guards them.
    if (container->is(VarKind::kModule)) tracer_.guard_container_items(container);
    int r = PySequence_Contains(container->value, item->value);
    if (r < 0) {
      PyErr_Clear();
      KILN_UNSUPPORTED() << "'in' on a " << container->describe() << " raised";
    }
    found = r;
  } else if (is_constant(container) && is_constant(item)) {
    PyObject* c = to_python(container);
    PyObject* i = to_python(item);
    int r = (c && i) ? PySequence_Contains(c, i) : -1;
    Py_XDECREF(c);
    Py_XDECREF(i);
    if (r < 0) {
      PyErr_Clear();
      KILN_UNSUPPORTED() << "'in' raised";
    }
    found = r;
  } else {
    KILN_UNSUPPORTED() << "'in' on a " << container->describe();
  }
  push(make_const((ins.arg ? !found : found) ? Py_True : Py_False));
}

void InstructionTranslator::op_build_tuple(const Instruction& ins) {
  push(make_sequence(VarKind::kTuple, pop_n(ins.arg)));
}

void InstructionTranslator::op_build_list(const Instruction& ins) {
  push(make_sequence(VarKind::kList, pop_n(ins.arg)));
}

void InstructionTranslator::op_build_set(const Instruction& ins) {
  push(tracer_.make_set(&PySet_Type, pop_n(ins.arg)));
}

void InstructionTranslator::op_set_add(const Instruction& ins) {
  VarPtr v = pop();
  tracer_.set_add(peek(ins.arg - 1), {v});
}

void InstructionTranslator::op_set_update(const Instruction& ins) {
  VarPtr seq = pop();
  tracer_.set_add(peek(ins.arg - 1), tracer_.iterate(seq));
}

void InstructionTranslator::op_build_map(const Instruction& ins) {
  std::vector<VarPtr> flat = pop_n(2 * ins.arg);
  std::vector<PyObject*> keys;
  std::vector<VarPtr> values;
  for (int i = 0; i < ins.arg; ++i) {
    const VarPtr& k = flat[2 * i];
    if (!k->is(VarKind::kConst)) KILN_UNSUPPORTED() << "dict key that is a " << k->describe();
    Py_INCREF(k->value);
    keys.push_back(k->value);
    values.push_back(flat[2 * i + 1]);
  }
  push(make_dict(std::move(keys), std::move(values)));
}

void InstructionTranslator::op_build_const_key_map(const Instruction& ins) {
  VarPtr key_tuple = pop();
  std::vector<VarPtr> values = pop_n(ins.arg);
  std::vector<PyObject*> keys;
  for (int i = 0; i < ins.arg; ++i) {
    PyObject* k = PyTuple_GET_ITEM(key_tuple->value, i);
    Py_INCREF(k);
    keys.push_back(k);
  }
  push(make_dict(std::move(keys), std::move(values)));
}

void InstructionTranslator::op_build_slice(const Instruction& ins) {
  std::vector<VarPtr> parts = pop_n(ins.arg);
  if (parts.size() == 2) parts.push_back(make_const(Py_None));
  VarPtr slice = make_sequence(VarKind::kSlice, std::move(parts));
  // (A slice by sizes stays a kSlice: indexing a tensor with it records symbolic bounds.)
  if (is_constant(slice) && !holds_symbolic_int(slice)) slice = make_const_steal(to_python(slice));
  push(slice);
}

void InstructionTranslator::op_build_string(const Instruction& ins) {
  std::vector<VarPtr> parts = pop_n(ins.arg);
  PyObject* out = PyUnicode_New(0, 0);
  for (const VarPtr& p : parts) {
    if (!p->is(VarKind::kConst) || !PyUnicode_Check(p->value)) {
      Py_DECREF(out);
      KILN_UNSUPPORTED() << "f-string of a " << p->describe();
    }
    PyUnicode_Append(&out, p->value);
  }
  push(make_const_steal(out));
}

void InstructionTranslator::op_format_value(const Instruction& ins) {
  // FORMAT_VALUE (3.11/3.12) with flags; FORMAT_SIMPLE (3.13) has none.
  bool has_spec = std::string(bytecode::opcodes().name(ins.opcode)) == "FORMAT_VALUE" && (ins.arg & 0x04);
  VarPtr spec = has_spec ? pop() : nullptr;
  VarPtr v = pop();
  if (!is_constant(v) || (spec && !is_constant(spec))) KILN_UNSUPPORTED() << "formatting a " << v->describe();
  PyObject* x = to_python(v);
  int conversion = std::string(bytecode::opcodes().name(ins.opcode)) == "FORMAT_VALUE" ? (ins.arg & 3) : 0;
  PyObject* converted = conversion == 1 ? PyObject_Str(x) : conversion == 2 ? PyObject_Repr(x)
                        : conversion == 3 ? PyObject_ASCII(x) : (Py_INCREF(x), x);
  Py_DECREF(x);
  PyObject* r = converted ? PyObject_Format(converted, spec ? spec->value : nullptr) : nullptr;
  Py_XDECREF(converted);
  if (!r) {
    PyErr_Clear();
    KILN_UNSUPPORTED() << "format raised";
  }
  push(make_const_steal(r));
}

void InstructionTranslator::op_list_append(const Instruction& ins) {
  VarPtr v = pop();
  VarPtr& list = peek(ins.arg - 1);
  if (!list->is(VarKind::kList) || list->source) KILN_UNSUPPORTED() << "append to a list from outside the trace";
  list->items.push_back(v);
}

void InstructionTranslator::op_list_extend(const Instruction& ins) {
  VarPtr seq = pop();
  VarPtr& list = peek(ins.arg - 1);
  if (!list->is(VarKind::kList) || list->source) KILN_UNSUPPORTED() << "extend of a list from outside the trace";
  for (VarPtr& item : tracer_.iterate(seq)) list->items.push_back(item);
}

void InstructionTranslator::op_list_to_tuple(const Instruction&) {
  VarPtr list = pop();
  push(make_sequence(VarKind::kTuple, list->items));
}

void InstructionTranslator::op_dict_update(const Instruction& ins) {
  VarPtr update = pop();
  VarPtr& dict = peek(ins.arg - 1);
  if (!dict->is(VarKind::kDict) || !update->is(VarKind::kDict) || dict->source)
    KILN_UNSUPPORTED() << "dict update of a " << update->describe();
  for (size_t i = 0; i < update->keys.size(); ++i) {
    Py_INCREF(update->keys[i]);
    dict->keys.push_back(update->keys[i]);
    dict->items.push_back(update->items[i]);
  }
}

void InstructionTranslator::op_map_add(const Instruction& ins) {
  VarPtr value = pop();
  VarPtr key = pop();
  VarPtr& dict = peek(ins.arg - 1);
  if (!key->is(VarKind::kConst) || !dict->is(VarKind::kDict)) KILN_UNSUPPORTED() << "dict comprehension key";
  Py_INCREF(key->value);
  dict->keys.push_back(key->value);
  dict->items.push_back(value);
}

void InstructionTranslator::op_call_intrinsic_1(const Instruction& ins) {
  // 3.12+: INTRINSIC_UNARY_POSITIVE = 5, INTRINSIC_LIST_TO_TUPLE = 6.
  if (ins.arg == 6) return op_list_to_tuple(ins);
  if (ins.arg == 5) {
    VarPtr v = pop();
    if (v->is(VarKind::kTensor)) {
      push(tracer_.call_recorded(operator_fn("pos"), {v}, {}));
      return;
    }
    push(v);
    return;
  }
  KILN_UNSUPPORTED() << "CALL_INTRINSIC_1 " << ins.arg;
}

void InstructionTranslator::op_unpack_sequence(const Instruction& ins) {
  VarPtr seq = pop();
  std::vector<VarPtr> items = tracer_.iterate(seq);
  if ((int)items.size() != ins.arg)
    KILN_UNSUPPORTED() << "unpacking " << items.size() << " values into " << ins.arg << " names";
  for (auto it = items.rbegin(); it != items.rend(); ++it) push(*it);
}

void InstructionTranslator::op_unpack_ex(const Instruction& ins) {
  int before = ins.arg & 0xFF, after = ins.arg >> 8;
  VarPtr seq = pop();
  std::vector<VarPtr> items = tracer_.iterate(seq);
  if ((int)items.size() < before + after) KILN_UNSUPPORTED() << "not enough values to unpack";
  std::vector<VarPtr> middle(items.begin() + before, items.end() - after);
  for (int i = 0; i < after; ++i) push(items[items.size() - 1 - i]);
  push(make_sequence(VarKind::kList, std::move(middle)));
  for (int i = before - 1; i >= 0; --i) push(items[i]);
}

}  // namespace kiln::trace

namespace kiln::trace {

namespace {
// Position of constant `key` among a dict Var's keys, or -1.
long dict_key_index(const VarPtr& dict, const VarPtr& key) {
  if (!key->is(VarKind::kConst) || key->by_type) KILN_UNSUPPORTED() << "dict key that is a " << key->describe();
  if (PyObject_Hash(key->value) == -1) {
    PyErr_Clear();
    KILN_UNSUPPORTED() << "unhashable dict key " << key->describe();
  }
  for (size_t i = 0; i < dict->keys.size(); ++i) {
    int eq = PyObject_RichCompareBool(dict->keys[i], key->value, Py_EQ);
    if (eq < 0) PyErr_Clear();
    if (eq == 1) return (long)i;
  }
  return -1;
}

long list_index(const VarPtr& list, const VarPtr& index) {
  if (!index->is(VarKind::kConst) || !PyLong_Check(index->value)) KILN_UNSUPPORTED() << "list index that is a " << index->describe();
  long long n = (long long)list->items.size(), k = PyLong_AsLongLong(index->value);
  if (k < 0) k += n;
  if (k < 0 || k >= n) KILN_UNSUPPORTED() << "list index out of range (IndexError in eager)";
  return (long)k;
}
}  // namespace

void InstructionTranslator::op_store_subscr(const Instruction&) {
  VarPtr key = pop();
  VarPtr container = pop();
  VarPtr value = pop();
  store_item(container, key, value);
}

// 3.12+: `container[start:stop] = value` (3.11 builds the slice and uses STORE_SUBSCR).
void InstructionTranslator::op_store_slice(const Instruction&) {
  VarPtr stop = pop();
  VarPtr start = pop();
  VarPtr container = pop();
  VarPtr value = pop();
  VarPtr slice = make_sequence(VarKind::kSlice, {start, stop, make_const(Py_None)});
  if (is_constant(slice)) slice = make_const_steal(to_python(slice));
  store_item(container, slice, value);
}

void InstructionTranslator::store_item(const VarPtr& container, const VarPtr& key, const VarPtr& value) {
  if ((container->is(VarKind::kDict) || container->is(VarKind::kList)) && !tracer_.claim_container(container))
    KILN_UNSUPPORTED() << "item assignment to a " << container->describe()
                       << " from outside the trace (the mutation would have to be replayed)";
  if (container->is(VarKind::kDict)) {
    long i = dict_key_index(container, key);
    if (i >= 0) {
      container->items[i] = value;
    } else {
      Py_INCREF(key->value);
      container->keys.push_back(key->value);
      container->items.push_back(value);
    }
    return;
  }
  if (container->is(VarKind::kList)) {
    container->items[list_index(container, key)] = value;
    return;
  }
  if (container->is(VarKind::kTensor)) {
    // x[i] = v: recorded as eager runs it (a view of x and an in-place copy_, fill_ or index_put_ into it).
    // passes/functionalize makes writes into tensors the graph made functional; a write into an input keeps the
    // eager interpreter, which writes the caller's tensor as eager does.
    tracer_.call_recorded(operator_fn("setitem"), {container, key, value}, {});
    return;
  }
  KILN_UNSUPPORTED() << "item assignment to a " << container->describe();
}

void InstructionTranslator::op_delete_subscr(const Instruction&) {
  VarPtr key = pop();
  VarPtr container = pop();
  if ((container->is(VarKind::kDict) || container->is(VarKind::kList)) && !tracer_.claim_container(container))
    KILN_UNSUPPORTED() << "del of an item of a " << container->describe() << " from outside the trace";
  if (container->is(VarKind::kDict)) {
    long i = dict_key_index(container, key);
    if (i < 0) KILN_UNSUPPORTED() << "del of a missing key (KeyError in eager)";
    Py_DECREF(container->keys[i]);
    container->keys.erase(container->keys.begin() + i);
    container->items.erase(container->items.begin() + i);
    return;
  }
  if (container->is(VarKind::kList)) {
    container->items.erase(container->items.begin() + list_index(container, key));
    return;
  }
  KILN_UNSUPPORTED() << "del of an item of a " << container->describe();
}

}  // namespace kiln::trace
