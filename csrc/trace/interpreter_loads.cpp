// Loads, stores and returns.
#include "common/error.h"
#include "common/type_dict.h"
#include "trace/interpreter.h"

namespace kiln::trace {

using bytecode::Instruction;

namespace {
constexpr bool kNullAfterCallable = PY_VERSION_HEX >= 0x030D0000;  // 3.13: [callable, NULL]

// Instances of these types never change: their methods are pure functions of the value and the arguments.
bool is_immutable_value(PyObject* o) {
  return PyUnicode_CheckExact(o) || PyBytes_CheckExact(o) || PyLong_CheckExact(o) || PyFloat_CheckExact(o) ||
         PyBool_Check(o) || PyComplex_CheckExact(o) || PyTuple_CheckExact(o) || PyFrozenSet_CheckExact(o);
}

// obj.name: super() proxies look along the MRO; methods of immutable values (`s.startswith`) stay bound to
// the value's Var, whose value is guarded (or is a trace-time constant), so a call of one can be folded.
VarPtr load_attribute(Tracer& tracer, const VarPtr& obj, PyObject* name) {
  if (obj->is(VarKind::kSuper)) return tracer.super_attr(obj, name);
  if (obj->is(VarKind::kConst) && obj->source && tracer.pin_context_var(obj)) {
    PyObject* descr = _PyType_Lookup(Py_TYPE(obj->value), name);
    if (descr && Py_TYPE(descr) == &PyMethodDescr_Type) return make_method(descr, obj);
  }
  if (obj->is(VarKind::kConst) && !obj->by_type && is_immutable_value(obj->value)) {
    PyObject* descr = _PyType_Lookup(Py_TYPE(obj->value), name);
    if (descr && Py_TYPE(descr) == &PyMethodDescr_Type) return make_method(descr, obj);
  }
  return tracer.get_attr(obj, name);
}
}  // namespace

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
  VarPtr v = tracer_.stored_value(globals_, name);
  if (v) {
    // assigned earlier in the trace (store_global)
  } else if (value) {
    v = tracer_.wrap(value, tracer_.global_source(globals_, name));
  } else {
    if (PyErr_Occurred()) PyErr_Clear();
    value = PyDict_Check(builtins_) ? PyDict_GetItemWithError(builtins_, name) : nullptr;
    if (!value) KILN_UNSUPPORTED() << "name '" << PyUnicode_AsUTF8(name) << "' is not defined";
    // Builtins are taken as fixed (shadowing them through the module's globals is guarded above:
    // the name is absent from globals).
    v = make_const(value);
    if (value == (PyObject*)&PySuper_Type) v = zero_arg_super(v);
  }
  push(v);
  if (push_null && kNullAfterCallable) push(make_null());
}

void InstructionTranslator::op_store_attr(const Instruction& ins) {
  VarPtr obj = pop();
  VarPtr value = pop();
  tracer_.store_attribute(obj, name_at(ins.arg), value);
}

void InstructionTranslator::op_delete_attr(const Instruction& ins) { tracer_.delete_attribute(pop(), name_at(ins.arg)); }

void InstructionTranslator::op_store_global(const Instruction& ins) {
  VarPtr value = pop();
  tracer_.store_global(globals_, name_at(ins.arg), value);
}

void InstructionTranslator::op_load_attr(const Instruction& ins) {
  // 3.12+: bit 0 of the argument asks for the method form ([NULL, bound] in our model).
  bool method = PY_VERSION_HEX >= 0x030C0000 && (ins.arg & 1);
  PyObject* name = name_at(PY_VERSION_HEX >= 0x030C0000 ? ins.arg >> 1 : ins.arg);
  VarPtr obj = pop();
  VarPtr attr = load_attribute(tracer_, obj, name);
  if (method && !kNullAfterCallable) push(make_null());
  push(attr);
  if (method && kNullAfterCallable) push(make_null());
}

void InstructionTranslator::op_load_method(const Instruction& ins) {
  VarPtr obj = pop();
  VarPtr attr = load_attribute(tracer_, obj, name_at(ins.arg));
  push(make_null());
  push(attr);
}

void InstructionTranslator::op_load_deref(const Instruction& ins) {
  VarPtr v = locals_.at(ins.arg);
  if (v && v->is(VarKind::kCell)) v = v->items[0];
  if (!v) KILN_UNSUPPORTED() << "reading an empty cell (NameError in eager)";
  push(v);
}

void InstructionTranslator::op_store_deref(const Instruction& ins) {
  VarPtr& slot = locals_.at(ins.arg);
  // Only cells of the trace can be written: a free variable of a function from outside belongs to an
  // enclosing frame whose state the graph cannot update (even once a closure made here shares it).
  int first_free = (int)PyTuple_GET_SIZE(code_->co_localsplusnames) - code_->co_nfreevars;
  if (ins.arg >= first_free) {
    size_t j = ins.arg - first_free;
    if (j >= trace_owned_free_.size() || !trace_owned_free_[j]) {
      // A real cell from outside (a nonlocal, or a resume function's cell of the frame it continues): the
      // assignment is made after the graph; this frame's later reads see the value.
      if (!closure_ || (Py_ssize_t)j >= PyTuple_GET_SIZE(closure_)) KILN_UNSUPPORTED() << "assigning a nonlocal variable";
      VarPtr value = pop();
      tracer_.store_cell((int)j, PyTuple_GET_ITEM(closure_, j), value);
      if (slot && slot->is(VarKind::kCell))
        slot->items[0] = value;
      else
        slot = value;
      return;
    }
  }
  // A cell shared with a closure made in the trace: both see the store.
  if (slot && slot->is(VarKind::kCell)) {
    slot->items[0] = pop();
    return;
  }
  slot = pop();
}

// ---- imports -----------------------------------------------------------------------------------------
// Only modules already in sys.modules are imported while tracing (an import that would run a module's
// code runs eagerly instead); the module is guarded by identity through sys.modules.

void InstructionTranslator::op_import_name(const Instruction& ins) {
  VarPtr fromlist = pop();
  VarPtr level = pop();
  if (!level->is(VarKind::kConst) || !PyLong_Check(level->value) || !fromlist->is(VarKind::kConst))
    KILN_UNSUPPORTED() << "import with a computed level or fromlist";
  push(tracer_.import_module(name_at(ins.arg), fromlist->value, (int)PyLong_AsLong(level->value), globals_));
}

void InstructionTranslator::op_import_from(const Instruction& ins) {
  push(tracer_.import_from(peek(), name_at(ins.arg)));
}

// ---- closures ----------------------------------------------------------------------------------------

void InstructionTranslator::op_load_closure(const Instruction& ins) {
  // The slot becomes a cell shared by this frame and the closures made from it.
  VarPtr& slot = locals_.at(ins.arg);
  if (!slot || !slot->is(VarKind::kCell)) slot = make_cell(slot);
  push(slot);
}

void InstructionTranslator::op_make_function(const Instruction& ins) {
  // 3.11/3.12 stack: [defaults] [kwdefaults] [annotations] [closure] code (flags 1, 2, 4, 8).
  VarPtr code = pop();
  VarPtr closure = (ins.arg & 0x08) ? pop() : nullptr;
  VarPtr annotations = (ins.arg & 0x04) ? pop() : nullptr;
  VarPtr kwdefaults = (ins.arg & 0x02) ? pop() : nullptr;
  VarPtr defaults = (ins.arg & 0x01) ? pop() : nullptr;
  KILN_ASSERT(code->is(VarKind::kConst) && PyCode_Check(code->value)) << "MAKE_FUNCTION without a code object";
  PyCodeObject* co = (PyCodeObject*)code->value;
  if (co->co_flags & (CO_COROUTINE | CO_ASYNC_GENERATOR))
    KILN_UNSUPPORTED() << "a coroutine or async generator function made in traced code";
  // Defaults become the real function's (inspect binds arguments with them): they must be known now.
  if ((defaults && !is_constant(defaults)) || (kwdefaults && !is_constant(kwdefaults)))
    KILN_UNSUPPORTED() << "a function made in traced code with defaults that are not constants";
  PyObject* fn = PyFunction_NewWithQualName(code->value, globals_, co->co_qualname);
  if (!fn) rethrow_python("making a function");
  VarPtr v = make_const_steal(fn);
  auto set = [&](const VarPtr& part, int (*setter)(PyObject*, PyObject*)) {
    if (!part) return;
    PyObject* value = to_python(part);
    int r = value ? setter(fn, value) : -1;
    Py_XDECREF(value);
    if (r < 0) rethrow_python("setting a function's defaults");
  };
  set(defaults, PyFunction_SetDefaults);
  set(kwdefaults, PyFunction_SetKwDefaults);
  // Annotations: the function may leave the trace (returned, or handed over at a break), with eager's
  // __annotations__. The stack holds them as a flat tuple of (name, value) pairs.
  if (annotations) {
    if (!is_constant(annotations)) KILN_UNSUPPORTED() << "a function made in traced code with traced annotations";
    PyObject* flat = to_python(annotations);
    PyObject* dict = flat && PyTuple_Check(flat) ? PyDict_New() : nullptr;
    for (Py_ssize_t i = 0; dict && i + 1 < PyTuple_GET_SIZE(flat); i += 2)
      if (PyDict_SetItem(dict, PyTuple_GET_ITEM(flat, i), PyTuple_GET_ITEM(flat, i + 1)) < 0) Py_CLEAR(dict);
    Py_XDECREF(flat);
    const int r = dict ? PyFunction_SetAnnotations(fn, dict) : -1;
    Py_XDECREF(dict);
    if (r < 0) rethrow_python("setting a function's annotations");
  }
  if (closure) {
    // With a closure the function is a kFunction: its cells hold Vars. Without one it is a plain constant
    // (what a graph break hands over is that function, the same on every call: eager makes a new, equal one).
    v->kind = VarKind::kFunction;
    KILN_ASSERT(closure->is(VarKind::kTuple)) << "MAKE_FUNCTION closure is not a tuple";
    // The real function gets empty cells: only its argument binding is used; the body is traced with
    // the Vars of the cells.
    PyObject* cells = PyTuple_New(closure->items.size());
    for (size_t i = 0; i < closure->items.size(); ++i) {
      KILN_ASSERT(closure->items[i]->is(VarKind::kCell)) << "closure item is not a cell";
      PyTuple_SET_ITEM(cells, i, PyCell_New(nullptr));
      v->items.push_back(closure->items[i]);
    }
    PyFunction_SetClosure(fn, cells);
    Py_DECREF(cells);
  }
  push(v);
}

// ---- super() -----------------------------------------------------------------------------------------

VarPtr InstructionTranslator::zero_arg_super(VarPtr plain_super) {
  // super() with no arguments reads the method's __class__ cell and its first argument.
  PyObject* freenames = PyCode_GetFreevars(code_);
  Py_ssize_t nfree = PyTuple_GET_SIZE(freenames), at = -1;
  for (Py_ssize_t j = 0; j < nfree; ++j)
    if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(freenames, j), "__class__") == 0) at = j;
  Py_DECREF(freenames);
  if (at < 0 || code_->co_argcount == 0) return plain_super;
  int nlocalsplus = (int)PyTuple_GET_SIZE(code_->co_localsplusnames);
  VarPtr cls = locals_[nlocalsplus - nfree + at];
  VarPtr self = locals_[0];
  if (cls && cls->is(VarKind::kCell)) cls = cls->items[0];
  if (self && self->is(VarKind::kCell)) self = self->items[0];
  if (!cls || !self || !cls->is(VarKind::kConst) || !PyType_Check(cls->value)) return plain_super;
  return make_super_factory(cls, self);
}

void InstructionTranslator::op_load_super_attr(const Instruction& ins) {
  // 3.12: [super, class, self] -> the attribute (bit 0: method form, pushed as [NULL, bound]).
  VarPtr self = pop();
  VarPtr cls = pop();
  pop();  // the global `super`, called implicitly
  bool method = ins.arg & 1;
  VarPtr attr = tracer_.super_attr(make_super(cls, self), name_at(ins.arg >> 2));
  if (method) push(make_null());
  push(attr);
}

namespace {
// A ContextVar.set still pending when the traced frame returns changes process state after it: eager must.
void refuse_pending_context_sets(const Tracer& tracer, const std::vector<VarPtr>& pending) {
  if (tracer.depth() == 0 && !pending.empty())
    KILN_UNSUPPORTED() << "ContextVar.set without its reset in the traced frame (process state that must persist)";
}
}  // namespace

void InstructionTranslator::op_return_value(const Instruction&) {
  refuse_pending_context_sets(tracer_, tracer_.context_var_sets_);
  returned_ = pop();
  done_ = true;
}

void InstructionTranslator::op_return_const(const Instruction& ins) {
  refuse_pending_context_sets(tracer_, tracer_.context_var_sets_);
  returned_ = make_const(PyTuple_GET_ITEM(code_->co_consts, ins.arg));
  done_ = true;
}

}  // namespace kiln::trace

namespace kiln::trace {

// ---- Tracer services for the handlers above ----------------------------------------------------------

VarPtr Tracer::super_attr(const VarPtr& super, PyObject* name) {
  const VarPtr& cls = super->items[0];
  const VarPtr& obj = super->items[1];
  if (!cls->is(VarKind::kConst) || !PyType_Check(cls->value)) KILN_UNSUPPORTED() << "super() of a " << cls->describe();
  // super(cls, obj) with obj a class (in a classmethod) searches obj's own MRO.
  bool of_class = obj->is(VarKind::kConst) && PyType_Check(obj->value) && !obj->by_type;
  // super().__new__ makes an object: it runs in Python (a frame using super() is never split, so that frame runs
  // eagerly). A GPU-machine run on Python 3.12 crashed under importlib's `_KeyedRef.__new__` (super().__new__ of
  // weakref.ref) while such frames were traced.
  const char* attr = PyUnicode_AsUTF8(name);
  if (attr && std::string(attr) == "__new__") KILN_UNSUPPORTED() << "super().__new__ (object creation runs in Python)";
  PyTypeObject* type = nullptr;
  switch (obj->kind) {
    case VarKind::kModule:
      if (obj->source) guards_->add_type(obj->source, Py_TYPE(obj->value));
      type = Py_TYPE(obj->value);
      break;
    case VarKind::kConst: type = of_class ? (PyTypeObject*)obj->value : Py_TYPE(obj->value); break;
    case VarKind::kTensor:
    case VarKind::kObject:
    case VarKind::kUserObject: type = obj->real_type; break;
    case VarKind::kDict: type = &PyDict_Type; break;
    case VarKind::kList: type = &PyList_Type; break;
    case VarKind::kTuple: type = obj->real_type ? obj->real_type : &PyTuple_Type; break;
    default: KILN_UNSUPPORTED() << "super() bound to a " << obj->describe();
  }
  PyObject* mro = type->tp_mro;
  Py_ssize_t n = PyTuple_GET_SIZE(mro), start = n;
  for (Py_ssize_t i = 0; i < n; ++i)
    if (PyTuple_GET_ITEM(mro, i) == cls->value) start = i + 1;
  if (start == n && n > 0 && PyTuple_GET_ITEM(mro, n - 1) != cls->value)
    KILN_UNSUPPORTED() << "super(" << ((PyTypeObject*)cls->value)->tp_name << ", obj): obj is not an instance or subtype";
  for (Py_ssize_t i = start; i < n; ++i) {
    PyObject* dict = type_dict((PyTypeObject*)PyTuple_GET_ITEM(mro, i));
    PyObject* attr = dict ? PyDict_GetItemWithError(dict, name) : nullptr;
    Py_XDECREF(dict);  // the type keeps its dict, and with it attr, alive
    if (!attr) {
      if (PyErr_Occurred()) rethrow_python("super() lookup");
      continue;
    }
    // Class attributes are taken as fixed, as for methods found on an object's type.
    if (PyFunction_Check(attr)) return of_class ? make_const(attr) : make_method(attr, obj);
    if (Py_TYPE(attr) == &PyStaticMethod_Type) {
      PyObject* f = PyObject_GetAttrString(attr, "__func__");
      if (!f) rethrow_python("staticmethod.__func__");
      return make_const_steal(f);
    }
    if (Py_TYPE(attr) == &PyClassMethod_Type) {
      PyObject* f = PyObject_GetAttrString(attr, "__func__");
      if (!f) rethrow_python("classmethod.__func__");
      VarPtr m = make_method(f, make_const(of_class ? obj->value : (PyObject*)type));
      Py_DECREF(f);
      return m;
    }
    if (Py_TYPE(attr) == &PyProperty_Type && !of_class) {
      PyObject* getter = PyObject_GetAttrString(attr, "fget");
      if (!getter) rethrow_python("property.fget");
      return call(make_const_steal(getter), {obj}, {});
    }
    // C methods (dict.get, object.__init__): bound to obj; calls of them go through call_python_construct.
    if (Py_TYPE(attr) == &PyMethodDescr_Type || Py_TYPE(attr) == &PyWrapperDescr_Type) return make_method(attr, obj);
    if (!Py_TYPE(attr)->tp_descr_get) return make_const(attr);  // a plain class attribute
    KILN_UNSUPPORTED() << "super()." << PyUnicode_AsUTF8(name) << ", a " << Py_TYPE(attr)->tp_name;
  }
  KILN_UNSUPPORTED() << "super()." << PyUnicode_AsUTF8(name) << " is not found (AttributeError in eager)";
}

VarPtr Tracer::import_module(PyObject* name, PyObject* fromlist, int level, PyObject* globals) {
  // A replaced builtins.__import__ (import hooks of some tools) decides what an import returns: eager runs it.
  PyObject* builtins = PyEval_GetBuiltins();
  PyObject* import_fn = PyDict_GetItemString(builtins, "__import__");
  static PyObject* original_import = import_fn;
  if (import_fn != original_import) KILN_UNSUPPORTED() << "import with builtins.__import__ replaced";
  std::string absolute = PyUnicode_AsUTF8(name);
  if (level > 0) {
    PyObject* package = PyDict_GetItemString(globals, "__package__");
    if (!package || !PyUnicode_Check(package)) KILN_UNSUPPORTED() << "relative import without __package__";
    std::string base = PyUnicode_AsUTF8(package);
    for (int i = 1; i < level; ++i) {
      size_t dot = base.rfind('.');
      if (dot == std::string::npos) KILN_UNSUPPORTED() << "relative import beyond the top-level package";
      base = base.substr(0, dot);
    }
    absolute = absolute.empty() ? base : base + "." + absolute;
  }
  PyObject* modules = PyImport_GetModuleDict();
  auto imported = [&](const std::string& module_name) -> VarPtr {
    PyObject* m = PyDict_GetItemString(modules, module_name.c_str());
    if (!m) KILN_UNSUPPORTED() << "import of " << module_name << ", which is not imported yet (its code would run)";
    return wrap(m, Source::dict_key(Source::object(modules, "sys.modules"), module_name));
  };
  VarPtr module = imported(absolute);
  bool has_fromlist = fromlist != Py_None && PyObject_IsTrue(fromlist) == 1;
  // `import a.b.c` binds the top-level package (after checking the whole chain is imported).
  if (!has_fromlist && level == 0 && absolute.find('.') != std::string::npos)
    return imported(absolute.substr(0, absolute.find('.')));
  return module;
}

VarPtr Tracer::import_from(const VarPtr& module, PyObject* name) {
  if (!module->is(VarKind::kConst) || !PyModule_Check(module->value)) KILN_UNSUPPORTED() << "from-import of a " << module->describe();
  if (PyObject_HasAttr(module->value, name)) return get_attr(module, name);
  // `from pkg import sub` of a submodule imported elsewhere but not yet bound on the package.
  const char* package = PyModule_GetName(module->value);
  if (!package) rethrow_python("module name");
  std::string full = std::string(package) + "." + PyUnicode_AsUTF8(name);
  PyObject* modules = PyImport_GetModuleDict();
  PyObject* m = PyDict_GetItemString(modules, full.c_str());
  if (!m) KILN_UNSUPPORTED() << "from " << package << " import " << PyUnicode_AsUTF8(name) << ": not imported yet";
  return wrap(m, Source::dict_key(Source::object(modules, "sys.modules"), full));
}

}  // namespace kiln::trace
