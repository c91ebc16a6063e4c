// Plain user objects made in traced code: `cache = DynamicCache()`, `layer = DynamicLayer()`, a small config view.
//
// Calling a plain user class (kiln._tracing.user_class_refusal says which classes are plain: object's __new__,
// __setattr__ and __getattribute__, a Python __init__, a plain instance layout) makes a kUserObject: no Python object
// exists while the trace runs, only the attribute table of the Var, which the inlined __init__ and every later
// `obj.name = value` fill. Reads follow object.__getattribute__: a data descriptor of the class (a property) first,
// then the table, then the class attribute (functions bound as methods and inlined, static and class methods, values
// read through the class's source, so guarded). Since the instance's whole state is the table, the trace knows every
// answer exactly: a missing attribute raises AttributeError in the trace, as eager would.
//
// The object becomes real only where it leaves the trace: a graph output, the frame's return value, a store to
// something outside, or a value live at a graph break. There OutputSpec::kNewObject makes `object.__new__(cls)` and
// fills its __dict__ from the table (tensors from the graph's outputs), once per Var (a memo slot), so one object
// reached through two paths stays one object. An object that never leaves the trace is never made, as no Python
// code could have observed it: its __init__'s side effects were traced like any other code.
#include <unordered_map>

#include "common/error.h"
#include "trace/call_helpers.h"
#include "trace/traced_raise.h"
#include "trace/tracer.h"

namespace kiln::trace {

namespace {

std::string str_of(PyObject* name) { return PyUnicode_AsUTF8(name); }

long table_index(const VarPtr& obj, PyObject* name) {
  for (size_t i = 0; i < obj->keys.size(); ++i)
    if (obj->keys[i] == name || PyUnicode_Compare(obj->keys[i], name) == 0) return (long)i;
  return -1;
}

[[noreturn]] void raise_attribute_error(const VarPtr& obj, PyObject* name, const char* doing) {
  PyErr_Format(PyExc_AttributeError, "'%.100s' object has no attribute '%U'", obj->real_type->tp_name, name);
  raise_pending(std::string(doing) + " ." + str_of(name));
}

// A data descriptor of the class (it runs code on assignment): a property, or object's own __class__ and __dict__.
PyObject* data_descriptor(PyTypeObject* type, PyObject* name) {
  PyObject* descr = _PyType_Lookup(type, name);
  return descr && Py_TYPE(descr)->tp_descr_set ? descr : nullptr;
}

// The property's fget, fset or fdel (new reference), or nullptr when it has none (None).
PyObject* property_part(PyObject* property, const char* part) {
  PyObject* f = PyObject_GetAttrString(property, part);
  if (!f) rethrow_python(std::string("property.") + part);
  if (f == Py_None) {
    Py_DECREF(f);
    return nullptr;
  }
  return f;
}

bool immutable_constant(PyObject* v) {
  return v == Py_None || PyBool_Check(v) || PyLong_CheckExact(v) || PyFloat_CheckExact(v) || PyUnicode_CheckExact(v);
}

// The class's own __getattribute__, __setattr__ or __delattr__ when written in Python (a config that maps aliased
// names, a strict dataclass that validates on assignment), else nullptr: object's, which the table implements.
PyObject* python_attribute_hook(PyTypeObject* type, const char* name) {
  PyObject* key = PyUnicode_InternFromString(name);
  PyObject* hook = key ? _PyType_Lookup(type, key) : nullptr;
  Py_XDECREF(key);
  return hook && PyFunction_Check(hook) ? hook : nullptr;
}

bool is_attribute_error(const VarPtr& exception) {
  return exception && exception->value && PyObject_IsInstance(exception->value, PyExc_AttributeError) == 1;
}

}  // namespace

VarPtr Tracer::construct_user_object(PyObject* cls, const SourcePtr& class_source, std::vector<VarPtr> args,
                                     KwArgs kwargs) {
  PyObject* refusal = PyObject_CallOneArg(helper("user_class_refusal"), cls);
  if (!refusal) rethrow_python("classifying a class");
  if (refusal != Py_None) {
    std::string why = PyUnicode_Check(refusal) ? str_of(refusal) : "?";
    Py_DECREF(refusal);
    KILN_UNSUPPORTED() << "constructing a " << ((PyTypeObject*)cls)->tp_name << " in traced code (" << why << ")";
  }
  Py_DECREF(refusal);
  PyTypeObject* type = (PyTypeObject*)cls;
  VarPtr obj = make_user_object(type, class_source);
  static PyObject* init_name = PyUnicode_InternFromString("__init__");
  PyObject* init = _PyType_Lookup(type, init_name);
  if (init && PyFunction_Check(init)) {
    args.insert(args.begin(), obj);
    VarPtr returned = inline_function(init, std::move(args), std::move(kwargs));
    if (!returned->is(VarKind::kConst) || returned->value != Py_None)
      KILN_UNSUPPORTED() << type->tp_name << ".__init__ returned a " << returned->describe() << " (TypeError in eager)";
  } else if (!args.empty() || !kwargs.empty()) {
    KILN_UNSUPPORTED() << type->tp_name << "() with arguments and object's __init__ (TypeError in eager)";
  }
  return obj;
}

VarPtr Tracer::user_object_attr(const VarPtr& obj, PyObject* name, bool* found) {
  KILN_ASSERT(obj->is(VarKind::kUserObject)) << "user_object_attr on a " << obj->describe();
  PyObject* hook = python_attribute_hook(obj->real_type, "__getattribute__");
  if (!hook) return raw_user_object_attr(obj, name, found);
  // The class's __getattribute__ is traced (it ends in object.__getattribute__, the table); getattr(x, n, d) and
  // hasattr see the AttributeError it raises, as in eager.
  if (found) *found = true;
  try {
    return call(make_method(hook, obj), {make_const(name)}, {});
  } catch (const TracedRaise& raised) {
    if (!found || !is_attribute_error(raised.exception())) throw;
  }
  *found = false;
  return nullptr;
}

VarPtr Tracer::raw_user_object_attr(const VarPtr& obj, PyObject* name, bool* found) {
  if (found) *found = true;
  PyTypeObject* type = obj->real_type;
  const std::string attr = str_of(name);
  if (attr == "__class__") return make_const((PyObject*)type, obj->class_source);
  if (attr == "__dict__") {
    // A view of the table that the trace may read but not change (a change through it would not reach the table).
    std::vector<PyObject*> keys;
    for (PyObject* k : obj->keys) keys.push_back(Py_NewRef(k));
    VarPtr view = make_dict(std::move(keys), obj->items);
    view->read_only = true;
    return view;
  }
  if (PyObject* descr = data_descriptor(type, name)) {
    if (Py_TYPE(descr) != &PyProperty_Type)
      KILN_UNSUPPORTED() << "reading ." << attr << " of a " << obj->describe() << " (a " << Py_TYPE(descr)->tp_name
                         << " of its class)";
    PyObject* getter = property_part(descr, "fget");
    if (!getter) {
      PyErr_Format(PyExc_AttributeError, "property '%U' of '%.100s' object has no getter", name, type->tp_name);
      raise_pending("reading ." + attr);
    }
    return call(make_const_steal(getter), {obj}, {});
  }
  long i = table_index(obj, name);
  if (i >= 0) return obj->items[i];
  PyObject* descr = _PyType_Lookup(type, name);
  if (!descr) {
    if (found) {
      *found = false;
      return nullptr;
    }
    raise_attribute_error(obj, name, "reading");
  }
  // Class attributes: functions are taken as fixed (as methods of modules are), other values are read through the
  // class and guarded.
  if (PyFunction_Check(descr)) return make_method(descr, obj);
  if (Py_TYPE(descr) == &PyStaticMethod_Type || Py_TYPE(descr) == &PyClassMethod_Type) {
    PyObject* f = PyObject_GetAttrString(descr, "__func__");
    if (!f) rethrow_python("the function of a static or class method");
    if (Py_TYPE(descr) == &PyStaticMethod_Type) return make_const_steal(f);
    VarPtr method = make_method(f, make_const((PyObject*)type, obj->class_source));
    Py_DECREF(f);
    return method;
  }
  // object's C slots (__init__, __setattr__...): bound, and handled by call_user_object.
  if (Py_TYPE(descr) == &PyWrapperDescr_Type || Py_TYPE(descr) == &PyMethodDescr_Type) return make_method(descr, obj);
  if (!Py_TYPE(descr)->tp_descr_get) {
    if (obj->class_source) return wrap(descr, Source::attr(obj->class_source, attr));
    if (immutable_constant(descr)) return make_const(descr);
    KILN_UNSUPPORTED() << "class attribute ." << attr << " of a " << obj->describe()
                       << " whose class was not read from the frame (its value is not guarded)";
  }
  KILN_UNSUPPORTED() << "reading ." << attr << " of a " << obj->describe() << " (a " << Py_TYPE(descr)->tp_name
                     << " of its class)";
}

void Tracer::store_user_object_attr(const VarPtr& obj, PyObject* name, const VarPtr& value) {
  if (PyObject* hook = python_attribute_hook(obj->real_type, "__setattr__")) {
    call(make_method(hook, obj), {make_const(name), value}, {});  // traced, down to object.__setattr__ (the table)
    return;
  }
  raw_store_user_object_attr(obj, name, value);
}

void Tracer::raw_store_user_object_attr(const VarPtr& obj, PyObject* name, const VarPtr& value) {
  if (PyObject* descr = data_descriptor(obj->real_type, name)) {
    if (Py_TYPE(descr) != &PyProperty_Type)
      KILN_UNSUPPORTED() << "assigning ." << str_of(name) << " of a " << obj->describe() << " (a "
                         << Py_TYPE(descr)->tp_name << " of its class)";
    PyObject* setter = property_part(descr, "fset");
    if (!setter) {
      PyErr_Format(PyExc_AttributeError, "property '%U' of '%.100s' object has no setter", name, obj->real_type->tp_name);
      raise_pending("assigning ." + str_of(name));
    }
    call(make_const_steal(setter), {obj, value}, {});
    return;
  }
  long i = table_index(obj, name);
  if (i >= 0) {
    obj->items[i] = value;  // a dict keeps the key's first position
    return;
  }
  obj->keys.push_back(Py_NewRef(name));
  obj->items.push_back(value);
}

void Tracer::delete_attribute(const VarPtr& obj, PyObject* name) {
  if (!obj->is(VarKind::kUserObject))
    KILN_UNSUPPORTED() << "deleting ." << str_of(name) << " of a " << obj->describe()
                       << " (only attributes of objects made in the traced code are deleted in the graph)";
  if (PyObject* hook = python_attribute_hook(obj->real_type, "__delattr__")) {
    call(make_method(hook, obj), {make_const(name)}, {});
    return;
  }
  raw_delete_attribute(obj, name);
}

void Tracer::raw_delete_attribute(const VarPtr& obj, PyObject* name) {
  if (PyObject* descr = data_descriptor(obj->real_type, name)) {
    PyObject* deleter = Py_TYPE(descr) == &PyProperty_Type ? property_part(descr, "fdel") : nullptr;
    if (!deleter)
      KILN_UNSUPPORTED() << "deleting ." << str_of(name) << " of a " << obj->describe() << " (a "
                         << Py_TYPE(descr)->tp_name << " of its class)";
    call(make_const_steal(deleter), {obj}, {});
    return;
  }
  long i = table_index(obj, name);
  if (i < 0) raise_attribute_error(obj, name, "deleting");
  Py_DECREF(obj->keys[i]);
  obj->keys.erase(obj->keys.begin() + i);
  obj->items.erase(obj->items.begin() + i);
}

namespace {

// The trace-time value of `v` with the objects made in the trace as stand-ins (one per Var, so shared stays shared).
PyObject* standin_value(const VarPtr& v, std::unordered_map<const Var*, PyObject*>& made) {
  if (auto it = made.find(v.get()); it != made.end()) return Py_NewRef(it->second);
  const bool list = v->is(VarKind::kList) && !v->real_type, tuple = v->is(VarKind::kTuple) && !v->real_type;
  if (!v->is(VarKind::kUserObject) && !list && !tuple) return to_python(v);
  PyObject* out = nullptr;
  if (v->is(VarKind::kUserObject)) {
    PyObject* no_args = PyTuple_New(0);
    out = PyBaseObject_Type.tp_new(v->real_type, no_args, nullptr);
    Py_DECREF(no_args);
  } else {
    out = list ? PyList_New(0) : nullptr;
  }
  if (out) made.emplace(v.get(), out);  // borrowed: `out` lives at least as long as the outermost call
  std::vector<PyObject*> items;
  for (const VarPtr& item : v->items) {
    PyObject* value = standin_value(item, made);
    if (!value) {
      for (PyObject* i : items) Py_DECREF(i);
      Py_XDECREF(out);
      return nullptr;
    }
    items.push_back(value);
  }
  if (tuple) {
    out = PyTuple_New(items.size());
    for (size_t i = 0; out && i < items.size(); ++i) PyTuple_SET_ITEM(out, i, items[i]);
    return out;
  }
  PyObject* dict = list ? nullptr : PyObject_GenericGetDict(out, nullptr);
  for (size_t i = 0; i < items.size(); ++i) {
    if (list) PyList_Append(out, items[i]);
    else if (dict) PyDict_SetItem(dict, v->keys[i], items[i]);
    Py_DECREF(items[i]);
  }
  Py_XDECREF(dict);
  return out;
}

}  // namespace

PyObject* Tracer::user_object_standin(const VarPtr& obj) {
  std::unordered_map<const Var*, PyObject*> made;
  PyObject* standin = standin_value(obj, made);
  if (!standin) rethrow_python("making a stand-in for a " + obj->describe());
  for (const auto& [var, object] : made)
    if (standins_.insert(object).second) Py_INCREF(object);
  return standin;
}

VarPtr Tracer::python_special_method(const VarPtr& obj, const char* name) {
  PyTypeObject* type = nullptr;
  if (obj->is(VarKind::kUserObject)) {
    type = obj->real_type;
  } else if (obj->is(VarKind::kConst)) {
    // dict, list and tuple subclasses (a ModelOutput from the frame) are read off their items by the tracer.
    PyObject* o = obj->value;
    if (PyType_Check(o) || PyModule_Check(o) || PyDict_Check(o) || PyList_Check(o) || PyTuple_Check(o)) return nullptr;
    type = Py_TYPE(o);
  } else {
    return nullptr;
  }
  PyObject* key = PyUnicode_InternFromString(name);
  PyObject* descr = key ? _PyType_Lookup(type, key) : nullptr;
  Py_XDECREF(key);
  return descr && PyFunction_Check(descr) ? make_method(descr, obj) : nullptr;
}

VarPtr Tracer::user_object_builtin(PyObject* f, const std::vector<VarPtr>& args, const KwArgs& kwargs) {
  const size_t n = args.size();
  if (n == 0 || !kwargs.empty()) return nullptr;
  const VarPtr& x = args[0];
  if (f == calls::builtin("len") && n == 1 && (x->is(VarKind::kUserObject) || x->by_type)) {
    // A __len__ written in Python (a user object's, made here or read from the frame by type) is traced.
    VarPtr dunder_len = python_special_method(x, "__len__");
    if (!dunder_len) {
      if (x->is(VarKind::kUserObject)) KILN_UNSUPPORTED() << "len() of a " << x->describe() << " (its class has no Python __len__)";
      return nullptr;
    }
    VarPtr length = call(dunder_len, {}, {});
    if (!length->is(VarKind::kConst) || !PyLong_Check(length->value) || PyLong_AsLongLong(length->value) < 0)
      KILN_UNSUPPORTED() << "__len__ of a " << x->describe() << " returned a " << length->describe();
    return length;
  }
  const bool has = f == calls::builtin("hasattr");
  if ((has || f == calls::builtin("getattr")) && (n == 2 || n == 3) && x->is(VarKind::kUserObject) &&
      args[1]->is(VarKind::kConst) && PyUnicode_Check(args[1]->value)) {
    // The attribute table is the object's whole state: the answer is exact, nothing to guard.
    bool found = false;
    VarPtr value = user_object_attr(x, args[1]->value, &found);
    if (has) return make_const(found ? Py_True : Py_False);
    if (found) return value;
    if (n == 3) return args[2];
    return user_object_attr(x, args[1]->value);  // raises AttributeError in the trace
  }
  const bool set = f == calls::builtin("setattr") && n == 3, del = f == calls::builtin("delattr") && n == 2;
  if ((set || del) && x->is(VarKind::kUserObject) && args[1]->is(VarKind::kConst) && PyUnicode_Check(args[1]->value)) {
    if (set) store_user_object_attr(x, args[1]->value, args[2]);
    else delete_attribute(x, args[1]->value);
    return make_const(Py_None);
  }
  return nullptr;
}

VarPtr Tracer::call_user_object(const VarPtr& fn, std::vector<VarPtr> args, KwArgs kwargs) {
  if (fn->is(VarKind::kUserObject)) {
    VarPtr dunder_call = python_special_method(fn, "__call__");
    if (!dunder_call) KILN_UNSUPPORTED() << "calling a " << fn->describe() << " (its class has no Python __call__)";
    return call(dunder_call, std::move(args), std::move(kwargs));
  }
  KILN_ASSERT(fn->is(VarKind::kMethod) && fn->items[0]->is(VarKind::kUserObject)) << "call_user_object on a " << fn->describe();
  const VarPtr& self = fn->items[0];
  PyObject* descr = fn->value;
  const bool object_slot = (Py_TYPE(descr) == &PyWrapperDescr_Type || Py_TYPE(descr) == &PyMethodDescr_Type) &&
                           PyDescr_TYPE(descr) == &PyBaseObject_Type;
  const std::string name = object_slot ? str_of(PyDescr_NAME(descr)) : "";
  const size_t n = args.size();
  auto attribute_name = [&](const VarPtr& v) {
    if (!v->is(VarKind::kConst) || !PyUnicode_Check(v->value))
      KILN_UNSUPPORTED() << "object." << name << " with an attribute name that is a " << v->describe();
    return v->value;
  };
  if (kwargs.empty()) {
    if (name == "__init__" && n == 0) return make_const(Py_None);  // object.__init__ (super().__init__())
    if (name == "__setattr__" && n == 2) {
      raw_store_user_object_attr(self, attribute_name(args[0]), args[1]);
      return make_const(Py_None);
    }
    if (name == "__getattribute__" && n == 1) return raw_user_object_attr(self, attribute_name(args[0]));
    if (name == "__delattr__" && n == 1) {
      raw_delete_attribute(self, attribute_name(args[0]));
      return make_const(Py_None);
    }
  }
  KILN_UNSUPPORTED() << "calling " << Py_TYPE(descr)->tp_name << " " << (name.empty() ? "?" : name) << " of a "
                     << self->describe();
}

}  // namespace kiln::trace
